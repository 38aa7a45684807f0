"""The "zero" parallelism mode (ZeRO stages 1-3), registered through ``blutrain_register_parallel_modes``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl
from blutrain_parallel_zero.flat import FlatBucket, Segment
from blutrain_parallel_zero.model import DEFAULT_BUCKET_CAP_MB, STAGES, Unit, ZeroModel
from blutrain_parallel_zero.optimizer import ZeroOptimizer
from blutrain_parallel_zero.zero import ZeRO

if TYPE_CHECKING:
    from blutrain.dist import ParallelModeRegistry


@hookimpl
def blutrain_register_parallel_modes(registry: ParallelModeRegistry) -> None:
    registry.register("zero", ZeRO)


__all__ = ["DEFAULT_BUCKET_CAP_MB", "STAGES", "FlatBucket", "Segment", "Unit", "ZeRO", "ZeroModel", "ZeroOptimizer",
           "blutrain_register_parallel_modes"]
