"""Registries of communication backends and parallelism modes, filled by their hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blutrain.dist import hookspecs
from blutrain.dist.parallel import ParallelMode
from blutrain.tensor import plugins
from blutrain.tensor.errors import PluginError
from blutrain.tensor.registry import Registry

ProcessGroupFactory = Callable[..., Any]


class CommBackendRegistry(Registry[ProcessGroupFactory]):
    """Backend name → process-group factory."""

    def __init__(self) -> None:
        super().__init__("communication backend", {"mpi": "blutrain-comm-mpi",
                                                   "nccl": "'blutrain-comm-nccl[cuda12]' (or [cuda13])"})


class ParallelModeRegistry(Registry[type[ParallelMode]]):
    """Mode name → parallelism-mode class (a subclass of :class:`ParallelMode`: the trainer reads its declared
    capabilities, so a class that does not inherit them is refused when it registers)."""

    def __init__(self) -> None:
        super().__init__("parallel mode", {mode: f"blutrain-parallel-{mode}" for mode in ("ddp", "zero", "tp", "cp")})

    def register(self, name: str, obj: type[ParallelMode]) -> None:
        if not (isinstance(obj, type) and issubclass(obj, ParallelMode)):
            got = obj.__name__ if isinstance(obj, type) else type(obj).__name__
            raise PluginError(f"{self.current_provider.plugin}: parallel mode {name!r} must be a subclass of "
                              f"blutrain.dist.ParallelMode (its declared capabilities), got {got}")
        super().register(name, obj)


def comm_backends() -> CommBackendRegistry:
    return plugins.registry("blutrain_register_comm_backends", CommBackendRegistry, hookspecs)


def parallel_modes() -> ParallelModeRegistry:
    return plugins.registry("blutrain_register_parallel_modes", ParallelModeRegistry, hookspecs)
