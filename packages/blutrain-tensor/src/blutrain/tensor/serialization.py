"""Tensors to and from safetensors files: an 8-byte little-endian header length, a JSON header, then
the raw little-endian bytes of every tensor.

This is BluTrain's one reader and writer of the format: ``load_file``/``save_file``, GPT-2's Hugging
Face weights and training checkpoints all go through it. The format executes no code when read (unlike
pickle), every framework reads it, and bfloat16 is "BF16".

Reading trusts nothing in the file. :func:`read_safetensors` checks the header length against the file
size and :data:`MAX_HEADER_BYTES`; parses the header as JSON with limits (duplicate keys, nesting too
deep for the parser and integers with too many digits are errors, not crashes); checks every entry
before any byte is used (exactly the keys dtype, shape and data_offsets; a known dtype; a shape of at
most :data:`MAX_NDIM` ints >= 0 that an array can address; data_offsets ``[begin, end]`` whose length
agrees with shape and dtype); checks that the entries tile the data section exactly (no gap, overlap or
trailing byte) and that ``__metadata__`` maps strings to strings. A BOOL tensor must hold only bytes 0
and 1. Every problem raises :class:`SerializationError` naming the file and what is wrong, and no other
exception escapes, whatever the bytes.

Writing (:func:`write_safetensors`, :func:`save_file`) goes to a temporary file ``.NAME.*.tmp`` in the
target's directory, which is flushed and ``fsync``-ed, renamed over the target (atomic on POSIX), and the
directory is ``fsync``-ed: the target name holds either its previous complete content or the new one,
whatever kills the process (``kill -9``, or power loss after the directory sync).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType, as_dtype, bool_
from blutrain.tensor.errors import SerializationError
from blutrain.tensor.tensor import Tensor, as_tensor_data, from_numpy

DTYPE_CODES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
"""BluTrain dtype name → safetensors dtype code, for every dtype a file can hold."""
MAX_HEADER_BYTES = 100 * 1024 * 1024  # as the reference implementation: a header is never larger
MAX_NDIM = 32  # NumPy 1.x's limit (2.x allows 64)
METADATA_KEY = "__metadata__"
_DTYPES = {code: as_dtype(name) for name, code in DTYPE_CODES.items()}
_NP_CODES = {dt.np.newbyteorder("<"): code for code, dt in _DTYPES.items()}
_MAX_EXTENT = 2**63 - 1  # bytes an array may span (NumPy's intp), counting a 0 dimension as 1


def _brief(value: Any, limit: int = 80) -> str:
    """repr of a value from a file, cut short: a file can hold a name of 100 MB."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class SafetensorsEntry:
    """One checked tensor entry of a header: dtype, shape and byte range ``[begin, end)`` of the data
    section."""

    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsFile:
    """A checked safetensors file in host memory: its entries (in header order), its metadata and its
    data section (``uint8``)."""

    path: Path
    entries: dict[str, SafetensorsEntry]
    metadata: dict[str, str]
    data: np.ndarray[Any, Any]

    def raw(self, name: str) -> np.ndarray[Any, Any]:
        """The bytes of tensor ``name`` (a ``uint8`` view of the data section)."""
        entry = self.entries[name]
        return self.data[entry.begin:entry.end]

    def array(self, name: str) -> np.ndarray[Any, Any]:
        """Tensor ``name`` as a host array in the native byte order; a view of the data section when its
        bytes are aligned for the dtype, else a copy."""
        entry = self.entries[name]
        raw = self.raw(name)
        if entry.dtype is bool_ and raw.size and int(raw.max()) > 1:
            raise SerializationError(f"{self.path}: tensor {_brief(name)} of dtype BOOL holds bytes other than "
                                     "0 and 1")
        arr = raw.view(entry.dtype.np.newbyteorder("<")).astype(entry.dtype.np, copy=False).reshape(entry.shape)
        return arr if arr.flags.aligned else arr.copy()

    def metadata_json(self, key: str) -> Any:
        """Metadata entry ``key`` parsed as JSON, with the limits of the header's parser."""
        if key not in self.metadata:
            raise SerializationError(f"{self.path}: metadata has no {key!r} entry; present: "
                                     f"{_brief(sorted(self.metadata), 200)}")
        return _decode_json(self.metadata[key], f"{self.path}: metadata {key!r}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # which of the two values was meant is unknowable
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {_brief(key)}")
            seen.add(key)
    return out


def _decode_json(text: str | bytes, source: str) -> Any:
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise SerializationError(f"{source} is not valid JSON: nested too deeply to parse") from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, an int of too many digits, a duplicate key
        raise SerializationError(f"{source} is not valid JSON: {exc}") from exc


def _fail(p: Path, what: str) -> SerializationError:
    return SerializationError(f"{p}: {what}")


def _check_entry(p: Path, name: str, info: Any) -> SafetensorsEntry:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        got = _brief(sorted(info)) if isinstance(info, dict) else type(info).__name__
        raise _fail(p, f"tensor {_brief(name)}: expected an object with dtype, shape and data_offsets, got {got}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise _fail(p, f"tensor {_brief(name)} has dtype {_brief(code)}; expected one of {', '.join(_DTYPES)}")
    dt = _DTYPES[code]
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(s) and s >= 0 for s in shape)):
        raise _fail(p, f"tensor {_brief(name)} has shape {_brief(shape)}; expected a list of at most {MAX_NDIM} "
                       "ints >= 0")
    extent = need = dt.itemsize
    for s in shape:
        extent *= max(s, 1)
        need *= s
    if extent > _MAX_EXTENT:  # NumPy cannot index it, even when a 0 makes it empty
        raise _fail(p, f"tensor {_brief(name)} has shape {_brief(shape)}, whose dimensions exceed what an array "
                       "can address")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _fail(p, f"tensor {_brief(name)} has data_offsets {_brief(offsets)}; expected [begin, end] with "
                       "0 <= begin <= end")
    if offsets[1] - offsets[0] != need:
        raise _fail(p, f"tensor {_brief(name)} of shape {shape} and dtype {code} needs {need} bytes, its "
                       f"data_offsets {offsets} give {offsets[1] - offsets[0]}")
    return SafetensorsEntry(dt, tuple(shape), offsets[0], offsets[1])


def _check_header(p: Path, header: dict[str, Any], data_size: int) -> tuple[dict[str, SafetensorsEntry],
                                                                             dict[str, str]]:
    metadata = header.get(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(p, f"{METADATA_KEY} must be an object of strings, got {_brief(metadata)}")
    entries = {name: _check_entry(p, name, info) for name, info in header.items() if name != METADATA_KEY}
    expected = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != expected:
            kind = "overlaps the previous tensor" if e.begin < expected else "leaves a gap before it"
            raise _fail(p, f"tensor {_brief(name)} starts at byte {e.begin} of the data section, expected "
                           f"{expected} ({kind})")
        if e.end > data_size:
            raise _fail(p, f"tensor {_brief(name)} occupies bytes [{e.begin}, {e.end}) but the data section holds "
                           f"{data_size} bytes (truncated or corrupted file)")
        expected = e.end
    if expected != data_size:
        raise _fail(p, f"{data_size - expected} bytes follow the last tensor in the data section, which the header "
                       "does not describe (corrupted header or file)")
    return entries, metadata


def _read(path: str | os.PathLike[str], with_data: bool) -> SafetensorsFile:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            if len(first) < 8:
                raise _fail(p, f"file of {size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", first)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise _fail(p, f"header claims {n} bytes but the file has {size} bytes (at most "
                               f"{MAX_HEADER_BYTES} allowed)")
            raw = f.read(n)
            if len(raw) != n:
                raise _fail(p, f"read {len(raw)} bytes of a {n}-byte header (file changed while read)")
            header = _decode_json(raw, f"{p}: header")
            if not isinstance(header, dict):
                raise _fail(p, f"header must be a JSON object, got {type(header).__name__}")
            entries, metadata = _check_header(p, header, size - 8 - n)
            data = np.fromfile(f, dtype=np.uint8, count=size - 8 - n) if with_data else np.empty(0, np.uint8)
    except FileNotFoundError as exc:
        raise _fail(p, "no such file") from exc
    except IsADirectoryError as exc:
        raise _fail(p, "is a directory, not a safetensors file") from exc
    except OSError as exc:
        raise _fail(p, f"cannot read: {exc.strerror or exc}") from exc
    if with_data and data.size != size - 8 - n:
        raise _fail(p, f"read {data.size} bytes of tensor data, expected {size - 8 - n} (file changed while read)")
    return SafetensorsFile(p, entries, metadata, data)


def read_safetensors(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Read and check a whole safetensors file (header, metadata, data section) into host memory.

    Raises :class:`SerializationError` naming the file and what is wrong; nothing else escapes."""
    return _read(path, with_data=True)


def load_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty when it has none); reads and checks only the
    header."""
    return _read(path, with_data=False).metadata


def load_file(path: str | os.PathLike[str], device: str | Device = "cpu") -> dict[str, Tensor]:
    """Every tensor of a safetensors file, checked as :func:`read_safetensors` does, on ``device``."""
    f = read_safetensors(path)
    out: dict[str, Tensor] = {}
    for name in f.entries:
        t = from_numpy(f.array(name))
        out[name] = t if str(device) == "cpu" else as_tensor_data(t, device=device)
    return out


# ------------------------------------------------------------------------------------------ writing
def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray[Any, Any]],
                      metadata: Mapping[str, str] | None = None, *,
                      progress: Callable[[BinaryIO, int, int], None] | None = None) -> Path:
    """Write host ``arrays`` and string ``metadata`` to ``path`` durably and atomically; returns the path.

    ``progress(file, written, total)`` (if given) is called once the header is written and after each
    tensor, with the tensor bytes written so far and their total. A write that is killed leaves only a
    ``.NAME.*.tmp`` file beside the target; a failed one removes it and raises :class:`SerializationError`.
    """
    target = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise _fail(target, f"metadata must map str to str; bad keys: {_brief(bad)}")
        header[METADATA_KEY] = dict(metadata)
    blobs: list[np.ndarray[Any, Any]] = []
    total = 0
    for name, a in arrays.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise _fail(target, f"tensor name {name!r} is not allowed; expected a str other than {METADATA_KEY!r}")
        if not isinstance(a, np.ndarray):
            raise _fail(target, f"tensor {name!r} is a {type(a).__name__}, not a numpy.ndarray")
        code = _NP_CODES.get(a.dtype.newbyteorder("<"))
        if code is None:
            raise _fail(target, f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot hold; expected "
                                f"one of {', '.join(DTYPE_CODES)}")
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)
        header[name] = {"dtype": code, "shape": list(np.shape(arrays[name])), "data_offsets": [total, total + a.size]}
        blobs.append(a)
        total += a.size
    head = json.dumps(header, separators=(",", ":")).encode()  # ASCII: json.dumps escapes the rest
    head += b" " * (-len(head) % 8)  # tensor data starts 8-byte aligned
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _fail(target, f"cannot create a temporary file beside it: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            if progress is not None:
                progress(f, 0, total)
            written = 0
            for blob in blobs:
                f.write(blob.data)
                written += blob.size
                if progress is not None:
                    progress(f, written, total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_directory(target.parent)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _fail(target, f"writing failed: {exc.strerror or exc}") from exc
        raise
    return target


def save_file(tensors: Mapping[str, Tensor], path: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (any devices; copied to host) and string ``metadata`` durably and atomically to
    ``path``."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise _fail(Path(path), f"tensor {name!r} is a {type(t).__name__}, not a Tensor")
        arrays[name] = np.asarray(t.device.backend.to_host(t.detach().array))
    write_safetensors(path, arrays, metadata)


__all__ = ["DTYPE_CODES", "MAX_HEADER_BYTES", "MAX_NDIM", "METADATA_KEY", "SafetensorsEntry", "SafetensorsFile",
           "SerializationError", "load_file", "load_metadata", "read_safetensors", "save_file",
           "write_safetensors"]
