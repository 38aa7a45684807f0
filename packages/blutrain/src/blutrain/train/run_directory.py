"""A run's output directory (``--out``): where a run goes by default, and that one run never overwrites another.

With no ``--out``, each run gets a fresh ``runs/<YYYYmmdd-HHMMSS>`` directory and ``runs/latest`` (a
symbolic link) points at the newest, so ``blutrain train`` twice keeps both runs and
``runs/latest/final.safetensors`` is always the last one. A resumed run without ``--out`` continues in its
checkpoint's directory. An ``--out`` that already holds a run is refused unless the run resumes (it continues
there) or ``--overwrite`` is given, which first deletes the old run's files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, TextIO

from blutrain.dist import RUN_ID_ENV
from blutrain.train.config import ConfigError

RUNS_ROOT = Path("runs")
LATEST = "latest"

# what a run writes into its directory: the files a new run would replace or mix with
_RUN_FILES = re.compile(r"(metrics\.jsonl|metrics\.csv|config\.toml|loss\.png|final(\.rank\d+-of-\d+)?\.safetensors"
                        r"|step_\d+(\.rank\d+-of-\d+)?\.safetensors|\..*\.safetensors\..*\.tmp)")
_RUN_DIRS = ("tensorboard",)


def run_files(directory: Path) -> list[Path]:
    """The files and folders of a run in ``directory`` (empty when it holds none or does not exist)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if (p.is_file() and _RUN_FILES.fullmatch(p.name)) or (p.is_dir() and p.name in _RUN_DIRS))


def job_id() -> str | None:
    """The id every rank of a job shares: ``blutrain run``'s ``BLUTRAIN_RUN_ID``, Slurm's job id (and step),
    or a torchrun rendezvous id given with ``--rdzv-id``; None where there is none."""
    run_id = os.environ.get(RUN_ID_ENV)
    if run_id:
        return run_id
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-{slurm}" + (f".{step}" if step else "")
    torchrun = os.environ.get("TORCHELASTIC_RUN_ID")
    if torchrun and torchrun != "none":
        return f"torchrun-{torchrun}"
    return None


def default_run_directory(world_size: int = 1, root: Path = RUNS_ROOT) -> Path:
    """A directory for a new run: ``root/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when that is taken), or
    ``root/<job id>`` where the process belongs to a job (:func:`job_id`), so that every rank picks the same.
    Ranks of a job without an id (mpirun, torchrun without ``--rdzv-id``) must be given ``--out``. A single
    process takes a time stamp even inside a Slurm allocation, where several runs share the job id."""
    run_id = job_id() if world_size > 1 else os.environ.get(RUN_ID_ENV)
    if run_id:
        return root / run_id
    if world_size > 1:
        raise ConfigError(f"out: this process is one of {world_size} ranks of a job without an id (started by "
                          "mpirun, or torchrun without --rdzv-id), so the ranks cannot agree on a default run "
                          "directory; give --out DIR")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def check_run_directory(out: Path, *, resuming: bool, overwrite: bool) -> list[Path]:
    """Refuse (:class:`ConfigError`) an ``out`` that is a file, that holds a run the run neither resumes nor
    overwrites, or whose nearest existing folder cannot be written; touches nothing (the trainer checks before
    it builds anything). Returns the old run's paths."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out: {out} is a file, expected a directory for the run's files; give another --out")
    old = run_files(out)
    if old and not resuming and not overwrite:
        names = ", ".join(p.name for p in old[:4]) + (", ..." if len(old) > 4 else "")
        raise ConfigError(f"out: {out} already holds a run ({names}); continue it with --resume "
                          f"{out / 'final.safetensors'} (or a step checkpoint), replace it with --overwrite, or "
                          "give another --out")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is a file" if not existing.is_dir() else "cannot be written"
        raise ConfigError(f"out: cannot write the run directory {out}: {existing} {what}; give a writable --out")
    return old


def prepare_run_directory(out: Path, *, resuming: bool, overwrite: bool) -> list[Path]:
    """Make ``out`` ready for a run (checked again as :func:`check_run_directory` does, created, written to
    once); returns the old run's paths that ``overwrite`` deleted. One process of a job calls it."""
    old = check_run_directory(out, resuming=resuming, overwrite=overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"out: cannot write the run directory {out}: {exc.strerror or exc}; give a writable "
                          "--out") from None
    removed = old if overwrite and not resuming else []
    for p in removed:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    return removed


def drop_metrics_after(path: Path, step: int) -> int:
    """Keep the rows of the metrics file ``path`` (JSON lines) up to ``step``, the step a run resumes from;
    the rows of steps after it, written before the run was stopped, would be written again. Returns the
    number of rows dropped. The file is replaced atomically."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            row_step = None  # a line cut short by a kill: not a row
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


class MetricsLog:
    """A run's ``metrics.jsonl``, one JSON row per step, flushed as written. A resumed run appends after the
    step it resumes from; the rows after that step (written before it was stopped) are dropped just before
    its first row is written, so a resume that fails before finishing a step leaves the file as it was."""

    def __init__(self, path: Path, resumed_step: int | None) -> None:
        self.path = path
        self.resumed_step = resumed_step
        self.file: TextIO | None = None

    def write(self, row: dict[str, Any]) -> int:
        """Append ``row``; returns how many old rows the first write of a resumed run dropped (else 0)."""
        dropped = 0
        if self.file is None:
            if self.resumed_step is not None:
                dropped = drop_metrics_after(self.path, self.resumed_step)
            self.file = open(self.path, "a" if self.resumed_step is not None else "w")  # noqa: SIM115
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        return dropped

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def point_latest(out: Path, root: Path = RUNS_ROOT) -> Path | None:
    """Make ``root/latest`` a symbolic link to ``out`` (relative, replaced atomically); returns the link, or
    None where ``latest`` is something else than a link (left alone) or links are not supported."""
    link = root / LATEST
    if link.exists() and not link.is_symlink():
        return None
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(os.path.relpath(out.resolve(), root.resolve()), target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return link


__all__ = ["RUNS_ROOT", "MetricsLog", "check_run_directory", "default_run_directory", "drop_metrics_after", "job_id",
           "point_latest", "prepare_run_directory", "run_files"]
