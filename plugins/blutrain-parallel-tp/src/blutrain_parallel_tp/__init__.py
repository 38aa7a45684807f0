"""The "tp" parallelism mode: Megatron tensor parallelism (column/row-parallel Linear, vocab-parallel
embedding and cross-entropy, attention heads split, async TP overlapping the all-reduces with the GEMMs),
registered through ``blutrain_register_parallel_modes``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl
from blutrain_parallel_tp.comm import copy_to_tp_region, reduce_from_tp_region
from blutrain_parallel_tp.cross_entropy import vocab_parallel_cross_entropy
from blutrain_parallel_tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    full_shape,
    gather_shard,
    shard_range,
    slice_shard,
)
from blutrain_parallel_tp.overlap import column_parallel_linear, row_parallel_linear
from blutrain_parallel_tp.tp import TP, TensorParallelModel

if TYPE_CHECKING:
    from blutrain.dist import ParallelModeRegistry


@hookimpl
def blutrain_register_parallel_modes(registry: ParallelModeRegistry) -> None:
    registry.register("tp", TP)


__all__ = ["TP", "ColumnParallelLinear", "RowParallelLinear", "Shard", "TensorParallelModel", "VocabParallelEmbedding",
           "blutrain_register_parallel_modes", "column_parallel_linear", "copy_to_tp_region", "full_shape",
           "gather_shard", "reduce_from_tp_region", "row_parallel_linear", "shard_range", "slice_shard",
           "vocab_parallel_cross_entropy"]
