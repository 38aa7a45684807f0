"""Training checkpoints: one safetensors file holding model, optimizer, trainer, data-loader and RNG
state, plus the run's config.

Tensors are stored as safetensors entries (``model.*``, ``optim.*``); everything else is JSON in the
file's metadata, so loading never executes code. A SHA-256 of every tensor's bytes is stored and
verified on load, so a flipped byte names the tensor it hit. The file is written to a temporary
name and renamed into place (see :func:`blutrain.tensor.serialization.save_file`), so an interrupted
save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.tensor import Tensor
from blutrain.tensor.errors import BluTrainError
from blutrain.tensor.serialization import SerializationError, load_file, load_metadata, save_file

FORMAT = "blutrain-checkpoint-1"


class CheckpointError(BluTrainError, ValueError):
    """A checkpoint is corrupted, truncated or not a BluTrain checkpoint; the message names the file."""


def _digest(t: Tensor) -> str:
    host = np.ascontiguousarray(t.device.backend.to_host(t.detach()._data))
    return hashlib.sha256(host.view(np.uint8).reshape(-1).tobytes() if host.size else b"").hexdigest()


def _flatten(value: Any, prefix: str, tensors: dict[str, Tensor]) -> Any:
    """Replace every Tensor inside nested dicts/lists by a reference, collecting the tensors."""
    if isinstance(value, Tensor):
        tensors[prefix] = value
        return {"__tensor__": prefix}
    if isinstance(value, dict):
        return {str(k): _flatten(v, f"{prefix}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _unflatten(value: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def save_checkpoint(path: str | Path, *, model_state: dict[str, Tensor], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any], loader_state: dict[str, Any], rng_state: dict[str, Any],
                    config: dict[str, Any]) -> Path:
    """Write one checkpoint file atomically; returns its path."""
    tensors: dict[str, Tensor] = {f"model.{k}": v for k, v in model_state.items()}
    optim_tree = _flatten(optimizer_state, "optim", tensors)
    digests = {name: _digest(t) for name, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "optimizer": json.dumps(optim_tree),
        "trainer": json.dumps(trainer_state),
        "loader": json.dumps(loader_state),
        "rng": json.dumps(rng_state),
        "config": json.dumps(config),
        "sha256": json.dumps(digests, sort_keys=True),
    }
    save_file(tensors, path, metadata)
    return Path(path)


def load_checkpoint(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint: returns model, optimizer, trainer, loader, rng and config states."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file")
    try:
        meta = load_metadata(p)
        tensors = load_file(p, device=device)
    except SerializationError as exc:
        raise CheckpointError(f"{p}: not a readable checkpoint: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{p}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        digests = json.loads(meta["sha256"])
        parsed = {k: json.loads(meta[k]) for k in ("optimizer", "trainer", "loader", "rng", "config")}
    except (KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{p}: metadata is incomplete or corrupted ({exc})") from None
    if set(digests) != set(tensors):
        missing = sorted(set(digests) ^ set(tensors))
        raise CheckpointError(f"{p}: tensors and stored checksums disagree on names: {missing[:5]}")
    for name, t in tensors.items():
        if _digest(t) != digests[name]:
            raise CheckpointError(f"{p}: tensor {name!r} fails its SHA-256 check; the file is corrupted")
    model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    return {"model": model_state, "optimizer": _unflatten(parsed["optimizer"], tensors),
            "trainer": parsed["trainer"], "loader": parsed["loader"], "rng": parsed["rng"],
            "config": parsed["config"]}
