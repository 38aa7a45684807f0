"""Sharded checkpoints: every rank writes its :class:`blutrain.dist.StateShard`, each file an ordinary
checkpoint (:func:`blutrain.train.save_checkpoint`: checksummed, atomic).

Rank 0's file is the checkpoint's name (``step_000010.safetensors``); rank ``r`` writes
``step_000010.rank{r}-of-{n}.safetensors`` beside it. Each file's optimizer state is
``{"sharded": index, "state": <this rank's optimizer pieces>}`` and its model tensors are this rank's
pieces; the index holds the shard's layout (ranges of the flattened tensors, their shapes, the
parameter groups by name) and the names of every rank's file. ``r`` and ``n`` are the rank and size of the
state-sharding mode's group: under tensor parallelism one tp group writes (the data-parallel replicas write
none); under ZeRO on a mesh every rank of dp (× cp) × tp holds a different part and writes.
:func:`load_any_checkpoint` reads a plain or a sharded checkpoint and returns whole state, which any
layout loads: another world size, DDP, tp, or a single process.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from blutrain.dist import DistArgumentError, StateShard, merge_shards
from blutrain.train.checkpoint import (
    CheckpointError,
    StagedCheckpoint,
    load_checkpoint,
    save_checkpoint,
    stage_checkpoint,
)

_SHARD_FILE = re.compile(r"(.+)\.rank(\d+)-of-(\d+)\.safetensors")
_STEP_NAME = re.compile(r"step_(\d+)")


def shard_file(path: str | Path, rank: int, world_size: int) -> Path:
    """The file rank ``rank`` of ``world_size`` writes for the checkpoint named ``path``."""
    p = Path(path)
    return p if rank == 0 else p.with_name(f"{p.stem}.rank{rank}-of-{world_size}{p.suffix}")


def _index(path: str | Path, shard: StateShard, rank: int, world_size: int) -> dict[str, Any]:
    return {**shard.layout(), "rank": rank, "world_size": world_size,
            "files": [shard_file(path, r, world_size).name for r in range(world_size)]}


def save_sharded_checkpoint(path: str | Path, shard: StateShard, *, rank: int, world_size: int,
                            trainer_state: dict[str, Any], loader_state: dict[str, Any], rng_state: dict[str, Any],
                            config: dict[str, Any]) -> Path:
    """Write this rank's file of the sharded checkpoint ``path``; every rank of the group calls it."""
    return save_checkpoint(shard_file(path, rank, world_size), model_state=dict(shard.params),
                           optimizer_state={"sharded": _index(path, shard, rank, world_size), "state": shard.optimizer},
                           trainer_state=trainer_state, loader_state=loader_state, rng_state=rng_state, config=config)


def stage_sharded_checkpoint(path: str | Path, shard: StateShard, *, rank: int, world_size: int,
                             trainer_state: dict[str, Any], loader_state: dict[str, Any], rng_state: dict[str, Any],
                             config: dict[str, Any]) -> tuple[StagedCheckpoint, Path]:
    """This rank's file of the sharded checkpoint ``path`` staged in host memory, and the file's name:
    what :class:`blutrain.train.CheckpointWriter` writes on its thread (an asynchronous save)."""
    staged = stage_checkpoint(model_state=dict(shard.params),
                              optimizer_state={"sharded": _index(path, shard, rank, world_size),
                                               "state": shard.optimizer},
                              trainer_state=trainer_state, loader_state=loader_state, rng_state=rng_state,
                              config=config)
    return staged, shard_file(path, rank, world_size)


def is_sharded(state: dict[str, Any]) -> bool:
    """Whether a state read by :func:`load_checkpoint` is one rank's file of a sharded checkpoint."""
    optimizer = state.get("optimizer")
    return isinstance(optimizer, dict) and "sharded" in optimizer


def _shard(p: Path, state: dict[str, Any], rank: int, world_size: int) -> StateShard:
    index = state["optimizer"].get("sharded")
    if not isinstance(index, dict) or index.get("rank") != rank or index.get("world_size") != world_size:
        got = {k: index.get(k) for k in ("rank", "world_size")} if isinstance(index, dict) else index
        raise CheckpointError(f"{p}: expected the shard of rank {rank} of {world_size}, found {got}")
    optimizer = state["optimizer"].get("state", {})
    try:
        return StateShard.from_layout(index, state["model"], optimizer, where=str(p))
    except DistArgumentError as exc:
        raise CheckpointError(str(exc)) from None


def load_any_checkpoint(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """:func:`load_checkpoint`'s dict with whole model and optimizer state, from a plain checkpoint or
    from every rank's file of a sharded one (which must all be beside ``path``)."""
    p = Path(path)
    state = load_checkpoint(p, device="cpu")
    if not is_sharded(state):
        return state if device == "cpu" else load_checkpoint(p, device=device)
    index = state["optimizer"]["sharded"]
    files, world = index.get("files"), index.get("world_size")
    if not isinstance(files, list) or not isinstance(world, int) or len(files) != world:
        raise CheckpointError(f"{p}: a sharded checkpoint's index must list one file per rank, got {files!r}")
    shards = []
    for r, name in enumerate(files):
        f = p.parent / str(name)
        if r == index.get("rank"):
            shards.append(_shard(p, state, r, world))
            continue
        if not f.is_file():
            raise CheckpointError(f"{p}: the shard of rank {r} of {world}, {f}, does not exist; a sharded "
                                  "checkpoint needs every rank's file")
        shards.append(_shard(f, load_checkpoint(f, device="cpu"), r, world))
    try:
        model, optimizer = merge_shards(shards)
    except DistArgumentError as exc:
        raise CheckpointError(f"{p}: {exc}") from None
    if device != "cpu":
        model = {k: v.to(device=device) for k, v in model.items()}
    return {**state, "model": model, "optimizer": optimizer}


def remove_orphan_shards(directory: str | Path, below_step: int | None = None) -> list[Path]:
    """Delete the rank files of sharded checkpoints whose rank-0 file is gone (rotated away).

    ``below_step``: only those of step checkpoints older than that step. The trainer passes its oldest kept
    step: another rank may already have written its file of a newer checkpoint (the next step's, or the final
    one) whose rank-0 file is still being written, and that file is no orphan."""
    d = Path(directory)
    gone = []
    for f in d.iterdir() if d.is_dir() else []:
        m = _SHARD_FILE.fullmatch(f.name)
        if not m:
            continue
        step = _STEP_NAME.fullmatch(m.group(1))
        if below_step is not None and (step is None or int(step.group(1)) >= below_step):
            continue
        if not (d / f"{m.group(1)}.safetensors").exists():
            f.unlink(missing_ok=True)
            gone.append(f)
    return gone


__all__ = ["is_sharded", "load_any_checkpoint", "remove_orphan_shards", "save_sharded_checkpoint", "shard_file",
           "stage_sharded_checkpoint"]
