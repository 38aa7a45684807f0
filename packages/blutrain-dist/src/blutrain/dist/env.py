"""Where a process learns its rank: ``blutrain run``, torchrun-style variables, mpirun, or Slurm.

Checked in that order; the first source whose variables are set wins. ``blutrain run`` sets the
torchrun-style ones plus ``BLUTRAIN_STORE`` (its own store's address) and the PMI variables MPI
reads, so one process started by it is readable by every backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from blutrain.dist.errors import DistEnvironmentError

STORE_ENV = "BLUTRAIN_STORE"
TIMEOUT_ENV = "BLUTRAIN_DIST_TIMEOUT"
RUN_ID_ENV = "BLUTRAIN_RUN_ID"  # set by `blutrain run`: the job's id (its start time), the same on every rank
DEFAULT_TIMEOUT = 1800.0  # seconds; as torch.distributed's default for store-based groups

# (source, rank, world size, local rank, local world size) variable names, in the order they are tried.
_SOURCES: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
)


@dataclass(frozen=True)
class DistEnv:
    """Rank and world of this process, and where the rendezvous store is (if anywhere)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # "blutrain run", "torchrun", "openmpi", "pmi", "slurm" or "single process"
    master_addr: str | None = None
    master_port: int | None = None
    store_addr: str | None = None  # "host:port" of a store hosted by the launcher
    timeout: float = DEFAULT_TIMEOUT


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.split("(")[0])  # SLURM_NTASKS_PER_NODE may read "4(x2)"
    except ValueError:
        raise DistEnvironmentError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in env:
            return _int(env, name)
    return None


def timeout_from(env: Mapping[str, str]) -> float:
    """The collective timeout in seconds: ``BLUTRAIN_DIST_TIMEOUT`` or 1800."""
    raw = env.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistEnvironmentError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous address; a single process when nothing is set."""
    env = os.environ if environ is None else environ
    timeout = timeout_from(env)
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    if (addr is None) != (port is None):
        raise DistEnvironmentError("MASTER_ADDR and MASTER_PORT must be set together, got "
                                   f"MASTER_ADDR={addr!r} MASTER_PORT={env.get('MASTER_PORT')!r}")
    for source, rank_var, size_var, local_vars, local_size_vars in _SOURCES:
        if rank_var not in env and size_var not in env:
            continue
        if rank_var not in env or size_var not in env:
            missing = rank_var if rank_var not in env else size_var
            raise DistEnvironmentError(f"{source}-style launch: {missing} is not set (the other of "
                                       f"{rank_var}/{size_var} is)")
        rank, world = _int(env, rank_var), _int(env, size_var)
        if world < 1 or not 0 <= rank < world:
            raise DistEnvironmentError(f"{rank_var}={rank} and {size_var}={world}: expected 0 <= rank < world size")
        local = _first(env, local_vars)
        local_size = _first(env, local_size_vars)
        store = env.get(STORE_ENV)
        return DistEnv(rank, world, rank if local is None else local, world if local_size is None else local_size,
                       "blutrain run" if store else source, addr, port, store, timeout)
    return DistEnv(0, 1, 0, 1, "single process", addr, port, None, timeout)


__all__ = ["DEFAULT_TIMEOUT", "STORE_ENV", "TIMEOUT_ENV", "DistEnv", "detect", "timeout_from"]
