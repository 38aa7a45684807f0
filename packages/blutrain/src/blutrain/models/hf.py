"""Hugging Face checkpoint directories: ``config.json`` beside ``model.safetensors``, or beside the sharded
form (``model.safetensors.index.json`` naming ``model-00001-of-0000N.safetensors`` files). A family's
``from_pretrained`` / ``save_pretrained`` translate config keys and tensor names; the reading, writing
and checking of the files is here. safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blutrain.models.errors import PretrainedError
from blutrain.tensor import Tensor
from blutrain.tensor.serialization import SerializationError, load_file, save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face directory as a dict; a missing or malformed file is a
    ``PretrainedError`` naming it."""
    path = Path(directory) / CONFIG_NAME
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise PretrainedError(f"{path}: not found; a pretrained directory holds config.json and model.safetensors "
                              f"(or {INDEX_NAME} and its shards)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PretrainedError(f"{path}: cannot read JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise PretrainedError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def read_hf_weights(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face directory by name: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (each shard must hold exactly the tensors the index assigns it)."""
    root = Path(directory)
    single, index = root / WEIGHTS_NAME, root / INDEX_NAME
    if single.is_file():
        return _load(single)
    if not index.is_file():
        raise PretrainedError(f"{root}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found; from_pretrained reads "
                              "safetensors only (no pickle files such as pytorch_model.bin)")
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise PretrainedError(f"{index}: cannot read a JSON object with a weight_map: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise PretrainedError(f"{index}: weight_map must map tensor names to shard file names")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if Path(shard).name != shard:
            raise PretrainedError(f"{index}: shard {shard!r} of {name} must be a file name in {root}")
        shards.setdefault(shard, set()).add(name)
    out: dict[str, Tensor] = {}
    for shard, names in sorted(shards.items()):
        tensors = _load(root / shard)
        if set(tensors) != names:
            extra, missing = sorted(set(tensors) - names), sorted(names - set(tensors))
            raise PretrainedError(f"{root / shard}: holds other tensors than {INDEX_NAME} assigns it (missing: "
                                  f"{', '.join(missing) or 'none'}; not in the index: {', '.join(extra) or 'none'})")
        out.update(tensors)
    return out


def _load(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise PretrainedError(f"{path}: not found (named by {INDEX_NAME})")
    try:
        return load_file(path)
    except SerializationError as exc:  # names the file and what is wrong
        raise PretrainedError(str(exc)) from exc


def write_hf_directory(directory: str | os.PathLike[str], config: Mapping[str, Any], tensors: Mapping[str, Tensor],
                       max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the tensors: one ``model.safetensors``, or with ``max_shard_bytes`` shards
    of at most that many bytes each (a tensor larger than that gets a shard of its own) and their
    ``model.safetensors.index.json``. Each file is written beside its target and renamed over it; a previous
save's files that this one does not replace are removed after it is written."""
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes <= 0):
        raise PretrainedError(f"save_pretrained: max_shard_bytes must be a positive int or None, got "
                              f"{max_shard_bytes!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    before = {root / WEIGHTS_NAME, root / INDEX_NAME, *root.glob("model-*-of-*.safetensors")}
    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.dtype.itemsize
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if max_shard_bytes is None:
        save_file(groups[0], root / WEIGHTS_NAME, metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(group, root / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, shard))
        total = sum(t.numel() * t.dtype.itemsize for t in tensors.values())
        _write_json(root / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(root / CONFIG_NAME, dict(config))
    written = {root / WEIGHTS_NAME} if max_shard_bytes is None else {
        root / INDEX_NAME, *(root / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups)))}
    for stale in before - written:  # a previous save's other form would be read instead of this one
        stale.unlink(missing_ok=True)


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


__all__ = ["CONFIG_NAME", "INDEX_NAME", "WEIGHTS_NAME", "read_hf_config", "read_hf_weights", "write_hf_directory"]
