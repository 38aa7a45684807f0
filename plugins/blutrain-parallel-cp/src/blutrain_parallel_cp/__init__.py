"""The "cp" parallelism mode: context parallelism (the sequence sharded in load-balanced causal chunks;
attention by ring, all-gather of K/V or all-to-all over heads), registered through
``blutrain_register_parallel_modes``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl
from blutrain_parallel_cp.attention import (
    ATTENTION_KINDS,
    allgather_attention,
    attend,
    context_parallel_attention,
    merge_partials,
    ring_attention,
    ulysses_attention,
)
from blutrain_parallel_cp.comm import all_gather, all_to_all, ring_shift, start_ring_shift
from blutrain_parallel_cp.cp import CP, ContextParallelAttentionCore, ContextParallelModel, sequence_loss
from blutrain_parallel_cp.layout import ChunkLayout

if TYPE_CHECKING:
    from blutrain.dist import ParallelModeRegistry


@hookimpl
def blutrain_register_parallel_modes(registry: ParallelModeRegistry) -> None:
    registry.register("cp", CP)


__all__ = ["ATTENTION_KINDS", "CP", "ChunkLayout", "ContextParallelAttentionCore", "ContextParallelModel",
           "all_gather", "all_to_all", "allgather_attention", "attend", "blutrain_register_parallel_modes",
           "context_parallel_attention", "merge_partials", "ring_attention", "ring_shift", "sequence_loss",
           "start_ring_shift", "ulysses_attention"]
