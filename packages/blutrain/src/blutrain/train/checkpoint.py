"""Training checkpoints: one safetensors file holding model, optimizer, trainer, data-loader and RNG
state, plus the run's config.

Tensors are safetensors entries (``model.*``, ``optim.*``); everything else is JSON in the header's
``__metadata__``, so loading parses JSON and copies bytes and never executes code. A SHA-256 of every
tensor's bytes, and one of the metadata, are stored and verified on load, so a flipped byte names the
tensor (or the metadata) it hit.

The file format is blutrain.tensor's: :func:`blutrain.tensor.write_safetensors` and
:func:`blutrain.tensor.read_safetensors` do the writing and the checking of the file; this module
decides what goes in it and checks that. Durability comes from that writer: a checkpoint is written
to a temporary file in the target directory, flushed and ``fsync``-ed, renamed over the target (atomic
on POSIX) and the directory is ``fsync``-ed, so the target name always holds either the previous
complete checkpoint or the new complete one, whatever kills the process (``kill -9``, power loss after
the directory sync). A killed save leaves only a ``.NAME.*.tmp`` file behind, which
:func:`remove_stale_temporaries` deletes.

A save has two halves: :func:`stage_checkpoint` copies every tensor to host memory through the device
backend's host-copy API (``Backend.to_host``: pinned memory on cuda, a copy on the CPU) and
:func:`write_checkpoint` hashes and writes the staged arrays. :func:`save_checkpoint` runs both;
:class:`CheckpointWriter` runs the second on a background thread, so a training loop is blocked only
for the staging.

The safetensors reader checks the whole header (dtypes, shapes, offsets that tile the data region
exactly) before it trusts any of it; this module then checks the checksums, the metadata's JSON and its
structure. Every problem raises :class:`CheckpointError` naming the file and what is wrong (a
:class:`blutrain.tensor.SerializationError` of the reader is its ``__cause__``).

Test hook: when the environment variable ``BLUTRAIN_CHECKPOINT_TEST_STALL`` names a file, a write
creates that file once half of its tensor bytes are on disk and then sleeps, so that a test can kill
the process in the middle of a save. It is read once per write, never in a training step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import numpy as np

from blutrain.tensor import (
    BluTrainError,
    SafetensorsFile,
    SerializationError,
    Tensor,
    from_numpy,
    read_safetensors,
    write_safetensors,
)
from blutrain.tensor.serialization import DTYPE_CODES

FORMAT = "blutrain-checkpoint-1"
STALL_VARIABLE = "BLUTRAIN_CHECKPOINT_TEST_STALL"
_JSON_FIELDS = ("optimizer", "trainer", "loader", "rng", "config", "sha256")
_STEP_FILE = re.compile(r"step_(\d+)\.safetensors")


class CheckpointError(BluTrainError, ValueError):
    """A checkpoint is corrupted, truncated, not a BluTrain checkpoint, or could not be written; the
    message names the file and what is wrong."""


# ------------------------------------------------------------------------------------------ staging
@dataclass
class StagedCheckpoint:
    """A checkpoint in host memory: arrays owned by nobody else, and the JSON-ready metadata."""

    arrays: dict[str, np.ndarray[Any, Any]]
    metadata: dict[str, str]
    nbytes: int = field(default=0)


def _host_copy(t: Tensor) -> np.ndarray[Any, Any]:
    data = t.array
    host = t.device.backend.to_host(data)
    if isinstance(data, np.ndarray) and np.may_share_memory(host, data):
        host = np.array(host, copy=True)  # the CPU backend hands out its own buffer: training would mutate it
    host = np.ascontiguousarray(host)
    return host.astype(host.dtype.newbyteorder("<"), copy=False)


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


def stage_checkpoint(*, model_state: dict[str, Tensor], optimizer_state: dict[str, Any],
                     trainer_state: dict[str, Any], loader_state: dict[str, Any], rng_state: dict[str, Any],
                     config: dict[str, Any]) -> StagedCheckpoint:
    """Copy every tensor to host memory and serialize the rest: what a save must do before training
    may touch the state again."""
    tensors: dict[str, Tensor] = {}
    for k, v in model_state.items():
        if not isinstance(v, Tensor):
            raise CheckpointError(f"stage_checkpoint: model_state[{k!r}] must be a Tensor, got {type(v).__name__}")
        tensors[f"model.{k}"] = v
    optim_tree = _flatten(optimizer_state, "optim", tensors)
    for name, t in tensors.items():
        if t.dtype.name not in DTYPE_CODES:
            raise CheckpointError(f"stage_checkpoint: tensor {name!r} has dtype {t.dtype.name}, which a "
                                  f"checkpoint cannot store; expected one of {', '.join(DTYPE_CODES)}")
    arrays = {name: _host_copy(t) for name, t in tensors.items()}
    metadata = {"format": FORMAT}
    for key, value in (("optimizer", optim_tree), ("trainer", trainer_state), ("loader", loader_state),
                       ("rng", rng_state), ("config", config)):
        try:
            metadata[key] = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"stage_checkpoint: the {key} state cannot be stored as JSON: {exc}") from None
    return StagedCheckpoint(arrays, metadata, sum(a.nbytes for a in arrays.values()))


# ------------------------------------------------------------------------------------------ writing
def _as_checkpoint_error(p: Path, exc: SerializationError) -> CheckpointError:
    """The safetensors layer's error as this module's, naming the file (its messages already do)."""
    message = str(exc)
    return CheckpointError(message if str(p) in message else f"{p}: {message}")


def write_checkpoint(staged: StagedCheckpoint, path: str | Path) -> Path:
    """Hash and write a staged checkpoint to ``path`` durably and atomically; returns the path."""
    target = Path(path)
    digests = {name: hashlib.sha256(a.reshape(-1).view(np.uint8).data).hexdigest()
               for name, a in staged.arrays.items()}
    meta = {**staged.metadata, "sha256": json.dumps(digests, sort_keys=True)}
    meta["metadata_sha256"] = _metadata_digest(meta)
    stall = os.environ.get(STALL_VARIABLE)

    def stall_half_way(f: BinaryIO, written: int, total: int) -> None:
        if stall and written * 2 >= total:
            _stall(f, stall)

    try:
        return write_safetensors(target, staged.arrays, meta, progress=stall_half_way if stall else None)
    except SerializationError as exc:
        raise _as_checkpoint_error(target, exc) from exc


def _metadata_digest(meta: dict[str, str]) -> str:
    """SHA-256 of every metadata entry but itself: the JSON states are checked like the tensors."""
    body = json.dumps({k: v for k, v in meta.items() if k != "metadata_sha256"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()  # ASCII: json.dumps escapes the rest


def _stall(f: BinaryIO, marker: str) -> None:
    f.flush()
    os.fsync(f.fileno())
    Path(marker).write_text(str(os.getpid()))
    time.sleep(3600)


def save_checkpoint(path: str | Path, *, model_state: dict[str, Tensor], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any], loader_state: dict[str, Any], rng_state: dict[str, Any],
                    config: dict[str, Any]) -> Path:
    """Stage and write one checkpoint (durably, atomically); returns its path."""
    staged = stage_checkpoint(model_state=model_state, optimizer_state=optimizer_state,
                              trainer_state=trainer_state, loader_state=loader_state, rng_state=rng_state,
                              config=config)
    return write_checkpoint(staged, path)


class CheckpointWriter:
    """Writes staged checkpoints on a background thread, one at a time.

    ``submit`` waits for the previous write (so at most one staged copy is held), then starts the next
    and returns at once. A failed write is kept and raised as :class:`CheckpointError` by the next
    ``check``, ``submit`` or ``wait`` — the trainer calls ``check`` at the start of every step, so a
    failure surfaces one step later, never silently. ``then`` runs on the writer thread after a
    successful write (the trainer rotates old checkpoints there, after the new one is durable).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None

    def _run(self, staged: StagedCheckpoint, path: Path, then: Callable[[Path], None] | None) -> None:
        try:
            write_checkpoint(staged, path)
            if then is not None:
                then(path)
        except BaseException as exc:  # kept for the training thread: a writer must never fail silently
            self._error = exc

    def submit(self, staged: StagedCheckpoint, path: str | Path,
               then: Callable[[Path], None] | None = None) -> None:
        self.wait()
        self._path = Path(path)
        self._thread = threading.Thread(target=self._run, args=(staged, self._path, then),
                                        name=f"checkpoint-writer:{self._path.name}", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a finished failed write; never waits."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"asynchronous checkpoint write failed: {error}") from error
            raise CheckpointError(f"{self._path}: asynchronous checkpoint write failed: "
                                  f"{type(error).__name__}: {error}") from error

    def wait(self) -> None:
        """Wait for the write in flight, then raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
        self.check()


# -------------------------------------------------------------------------------- directory upkeep
def step_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``step_NNNNNN.safetensors`` files of ``directory`` as (step, path), oldest first."""
    d = Path(directory)
    found = []
    for p in d.iterdir() if d.is_dir() else []:
        m = _STEP_FILE.fullmatch(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def rotate_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest step checkpoints of ``directory`` (``keep`` 0: keep all);
    returns the deleted paths."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise CheckpointError(f"rotate_checkpoints: keep must be an int >= 0, got {keep!r}")
    if keep == 0:
        return []
    old = [p for _, p in step_checkpoints(directory)[:-keep]]
    for p in old:
        p.unlink(missing_ok=True)
    return old


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporary files of saves that were killed before their rename; returns them."""
    d = Path(directory)
    stale = [p for p in d.glob(".*.safetensors.*.tmp") if p.is_file()] if d.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


# ------------------------------------------------------------------------------------------ reading
def _fail(p: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{p}: {what}")


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_json(p: Path, st: SafetensorsFile, key: str, kind: type) -> Any:
    try:
        value = st.metadata_json(key)
    except SerializationError as exc:
        raise _as_checkpoint_error(p, exc) from exc
    if not isinstance(value, kind):
        raise _fail(p, f"metadata {key!r} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def _unflatten(p: Path, value: Any, tensors: dict[str, Tensor], depth: int = 0) -> Any:
    if depth > 64:
        raise _fail(p, "metadata 'optimizer' is nested more than 64 levels deep")
    if isinstance(value, dict):
        if "__tensor__" in value:
            ref = value["__tensor__"]
            if len(value) != 1 or not isinstance(ref, str) or ref not in tensors:
                raise _fail(p, f"metadata 'optimizer' refers to tensor {ref!r}, which the file does not hold")
            return tensors[ref]
        return {k: _unflatten(p, v, tensors, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(p, v, tensors, depth + 1) for v in value]
    return value


def _check_trainer_state(p: Path, trainer: dict[str, Any]) -> None:
    step = trainer.get("step")
    if not _is_int(step) or step < 0:
        raise _fail(p, f"metadata 'trainer' has step {step!r}; expected an int >= 0")
    history = trainer.get("val_history", [])
    if not isinstance(history, list) or not all(
            isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and isinstance(v[1], (int, float)) for v in history):
        raise _fail(p, "metadata 'trainer' has a val_history that is not a list of [step, loss] pairs")
    skipped = trainer.get("skipped_steps", [])
    if not isinstance(skipped, list) or not all(_is_int(s) for s in skipped):
        raise _fail(p, "metadata 'trainer' has skipped_steps that are not a list of ints")


def _check_looks_like_safetensors(p: Path) -> None:
    """A file that does not start as every safetensors file does (an 8-byte header length, then the JSON
    header's opening brace) is some other file, not a damaged checkpoint: say so, rather than report what
    its first bytes would mean as a header length. Unreadable files are left to the reader, whose messages
    say why."""
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(9)
    except OSError:
        return
    if len(head) == 9 and head[8:9] == b"{":
        return  # a safetensors file, perhaps cut short or damaged: the reader names what is wrong
    raise _fail(p, f"not a BluTrain checkpoint: the file ({size} bytes) is not in the safetensors format that "
                   "`blutrain train` writes (e.g. runs/latest/final.safetensors)")


def load_checkpoint(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint: returns model, optimizer, trainer, loader, rng and config states.

    Raises :class:`CheckpointError` naming the file and what is wrong: a malformed header, a tensor
    whose bytes fail their SHA-256 (named), missing or malformed metadata. Nothing in the file is
    executed: the header and metadata are JSON, the tensors raw bytes.
    """
    p = Path(path)
    _check_looks_like_safetensors(p)
    try:
        st = read_safetensors(p)
    except SerializationError as exc:
        raise _as_checkpoint_error(p, exc) from exc
    meta = st.metadata
    if not meta:
        raise _fail(p, "has no __metadata__; not a BluTrain checkpoint")
    if meta.get("format") != FORMAT:
        hint = ("; a model in the Hugging Face layout is read by `blutrain train --init-from DIR`"
                if meta.get("format") == "pt" else "")
        raise _fail(p, f"not a BluTrain checkpoint: its format is {meta.get('format')!r}, expected {FORMAT!r}{hint}")
    # checkpoints written before the metadata had its own checksum have none; a present one must match
    if "metadata_sha256" in meta and meta["metadata_sha256"] != _metadata_digest(meta):
        raise _fail(p, "the metadata (optimizer, trainer, loader, rng or config state) fails its SHA-256 check; "
                       "the file is corrupted")
    parsed = {key: _parse_json(p, st, key, dict) for key in _JSON_FIELDS}
    digests = parsed["sha256"]
    if set(digests) != set(st.entries):
        differ = sorted(set(digests) ^ set(st.entries))
        raise _fail(p, f"tensors and stored checksums disagree on names: {differ[:5]}")
    tensors: dict[str, Tensor] = {}
    for name in st.entries:
        if hashlib.sha256(st.raw(name).data).hexdigest() != digests[name]:
            raise _fail(p, f"tensor {name!r} fails its SHA-256 check; the file is corrupted")
        try:
            t = from_numpy(st.array(name))
        except SerializationError as exc:
            raise _as_checkpoint_error(p, exc) from exc
        tensors[name] = t if device == "cpu" else t.to(device=device)
    _check_trainer_state(p, parsed["trainer"])
    optimizer = _unflatten(p, parsed["optimizer"], tensors)
    model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    return {"model": model_state, "optimizer": optimizer, "trainer": parsed["trainer"], "loader": parsed["loader"],
            "rng": parsed["rng"], "config": parsed["config"]}


__all__ = ["FORMAT", "STALL_VARIABLE", "CheckpointError", "CheckpointWriter", "StagedCheckpoint",
           "load_checkpoint", "remove_stale_temporaries", "rotate_checkpoints", "save_checkpoint",
           "stage_checkpoint", "step_checkpoints", "write_checkpoint"]
