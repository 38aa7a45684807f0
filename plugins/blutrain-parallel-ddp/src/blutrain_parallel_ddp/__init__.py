"""The "ddp" parallelism mode: bucketed gradient all-reduce overlapping backward, registered through
``blutrain_register_parallel_modes``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl
from blutrain_parallel_ddp.ddp import (
    DDP,
    DEFAULT_BUCKET_CAP_MB,
    GRAD_DTYPES,
    GRAD_REDUCTIONS,
    DistributedDataParallel,
    GradBucket,
)

if TYPE_CHECKING:
    from blutrain.dist import ParallelModeRegistry


@hookimpl
def blutrain_register_parallel_modes(registry: ParallelModeRegistry) -> None:
    registry.register("ddp", DDP)


__all__ = ["DDP", "DEFAULT_BUCKET_CAP_MB", "GRAD_DTYPES", "GRAD_REDUCTIONS", "DistributedDataParallel", "GradBucket",
           "blutrain_register_parallel_modes"]
