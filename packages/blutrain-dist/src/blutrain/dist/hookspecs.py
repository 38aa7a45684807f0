"""Hook specifications owned by blutrain-dist: communication backends and parallelism modes.

Both are registry hooks: called once, when the registry is first needed; every implementation is
called and adds entries with ``registry.register(name, obj)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from blutrain.dist.registry import CommBackendRegistry, ParallelModeRegistry

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_register_comm_backends(registry: CommBackendRegistry) -> None:
    """Add process-group factories by name (``"nccl"``, ``"mpi"``, ...).

    The factory is called by ``init_process_group`` as ``factory(rank=..., world_size=..., store=...,
    timeout=..., env=..., **options)`` (``store`` a :class:`blutrain.dist.Store` or None where no
    rendezvous address is known; ``env`` the :class:`blutrain.dist.DistEnv` read) and returns an
    object implementing :class:`blutrain.dist.ProcessGroup`.
    """


@hookspec
def blutrain_register_parallel_modes(registry: ParallelModeRegistry) -> None:
    """Add parallelism modes by name (``"ddp"``, ``"zero"``, ``"tp"``, ``"cp"``).

    A mode is a class implementing :class:`blutrain.dist.ParallelMode`, constructed as
    ``Mode(mesh, **options)``: it wraps or rewrites a model and its optimizer for a device mesh.
    """
