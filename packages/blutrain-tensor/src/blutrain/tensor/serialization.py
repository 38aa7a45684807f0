"""Tensors to and from safetensors files: a JSON header and raw little-endian bytes.

The format executes no code when read (unlike pickle), is read by every framework, and maps
bfloat16 as "BF16". Writes go to a temporary file that is renamed into place, so a crash mid-write
never leaves a half file under the final name. Every malformed file raises
:class:`SerializationError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType, as_dtype
from blutrain.tensor.errors import BluTrainError
from blutrain.tensor.tensor import Tensor, as_tensor_data, from_numpy

_CODES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
          "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
_NAMES = {v: k for k, v in _CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SerializationError(BluTrainError, ValueError):
    """A safetensors file is malformed or does not hold what was asked for."""


def save_file(tensors: Mapping[str, Tensor], path: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (any devices; copied to host) and string ``metadata`` atomically to ``path``."""
    header: dict[str, Any] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise SerializationError(f"save_file: metadata must map str to str; bad keys: {bad}")
        header["__metadata__"] = dict(metadata)
    blobs: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise SerializationError(f"save_file: {name!r} is a {type(t).__name__}, not a Tensor")
        host = np.ascontiguousarray(t.device.backend.to_host(t.detach()._data))
        raw = host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _CODES[t.dtype.name], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for raw in blobs:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the byte offset where tensor data starts."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise SerializationError(f"{p}: file of {size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", first)
            if n > min(size - 8, _MAX_HEADER):
                raise SerializationError(f"{p}: header claims {n} bytes but the file has {size} bytes")
            raw = f.read(n)
    except OSError as exc:
        raise SerializationError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SerializationError(f"{p}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SerializationError(f"{p}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n


def load_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    header, _ = read_header(path)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise SerializationError(f"{path}: __metadata__ must be an object")
    return {str(k): str(v) for k, v in meta.items()}


def load_file(path: str | os.PathLike[str], device: str | Device = "cpu") -> dict[str, Tensor]:
    """Every tensor of a safetensors file, checked against the header, on ``device``."""
    header, start = read_header(path)
    p = Path(path)
    data = np.fromfile(p, dtype=np.uint8, offset=start)
    out: dict[str, Tensor] = {}
    expected_offset = 0
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1].get("data_offsets", [0])[0] if isinstance(kv[1], dict) else 0)
    for name, info in entries:
        dt, shape, begin, end = _entry(p, name, info)
        if begin != expected_offset or end > data.size:
            raise SerializationError(f"{p}: tensor {name!r} occupies bytes [{begin}, {end}) but the data region "
                                     f"holds {data.size} bytes (next expected offset {expected_offset})")
        expected_offset = end
        count = int(np.prod(shape)) if shape else 1
        if (end - begin) != count * dt.itemsize:
            raise SerializationError(f"{p}: tensor {name!r} of shape {shape} and dtype {dt.name} needs "
                                     f"{count * dt.itemsize} bytes, header gives {end - begin}")
        arr = data[begin:end].view(dt.np.newbyteorder("<")).astype(dt.np, copy=False).reshape(shape).copy()
        t = from_numpy(arr)
        out[name] = t if str(device) == "cpu" else as_tensor_data(t, device=device)
    if expected_offset != data.size:
        raise SerializationError(f"{p}: {data.size - expected_offset} trailing bytes after the last tensor "
                                 "(truncated header or corrupted file)")
    return out


def _entry(p: Path, name: str, info: Any) -> tuple[DType, list[int], int, int]:
    if not isinstance(info, dict):
        raise SerializationError(f"{p}: entry {name!r} must be an object")
    code = info.get("dtype")
    if code not in _NAMES:
        raise SerializationError(f"{p}: tensor {name!r} has unsupported dtype {code!r}; expected one of "
                                 f"{', '.join(_NAMES)}")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
        raise SerializationError(f"{p}: tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise SerializationError(f"{p}: tensor {name!r} has invalid data_offsets {offsets!r}")
    return as_dtype(_NAMES[code]), shape, offsets[0], offsets[1]


__all__ = ["SerializationError", "load_file", "load_metadata", "read_header", "save_file"]
