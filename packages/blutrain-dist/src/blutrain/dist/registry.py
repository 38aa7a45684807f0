"""Registries of communication backends and parallelism modes, filled by their hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blutrain.tensor import plugins
from blutrain.tensor.registry import Registry

from blutrain.dist import hookspecs

ProcessGroupFactory = Callable[..., Any]


class CommBackendRegistry(Registry[ProcessGroupFactory]):
    """Backend name → process-group factory."""

    def __init__(self) -> None:
        super().__init__("communication backend", {"mpi": "blutrain-comm-mpi",
                                                   "nccl": "'blutrain-comm-nccl[cuda12]' (or [cuda13])"})


class ParallelModeRegistry(Registry[type]):
    """Mode name → parallelism-mode class."""

    def __init__(self) -> None:
        super().__init__("parallel mode", {mode: f"blutrain-parallel-{mode}" for mode in ("ddp", "zero", "tp", "cp")})


def comm_backends() -> CommBackendRegistry:
    plugins.add_hookspecs(hookspecs)
    return plugins.registry("blutrain_register_comm_backends", CommBackendRegistry)


def parallel_modes() -> ParallelModeRegistry:
    plugins.add_hookspecs(hookspecs)
    return plugins.registry("blutrain_register_parallel_modes", ParallelModeRegistry)
