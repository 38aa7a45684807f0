"""Tensor-parallel layers: column- and row-parallel Linear, vocab-parallel Embedding.

Each layer holds this rank's shard of the full parameter and says how it was cut (a :class:`Shard`),
so the full tensor can be sliced from a single-process checkpoint (``from_linear`` /
``from_embedding``) and gathered back (:func:`gather_shard`).

- ``ColumnParallelLinear``: rows of ``weight`` (output features) split; forward
  ``linear(copy_to_tp_region(x), W_r, b_r)``, the output stays split along its last dim.
- ``RowParallelLinear``: columns of ``weight`` (input features) split, the input arrives split;
  forward ``reduce_from_tp_region(linear(x_r, W_r)) + b`` (the bias is added once, after the sum).
- ``VocabParallelEmbedding``: rows of the table (the vocabulary) split; ids outside this rank's
  range look up nothing (zeros) and the partial lookups are summed over the group.

With ``async_chunks=k`` (k >= 1) the two Linears run as the fused ops of
:mod:`blutrain_parallel_tp.overlap` instead: the same results, their all-reduce cut into k row blocks
that overlap the GEMMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from blutrain.autograd import no_grad
from blutrain.dist import DistArgumentError, ProcessGroup
from blutrain.nn import Embedding, Linear, Module, Parameter, init
from blutrain.tensor import Tensor, cat, embedding, empty, linear, logical_or
from blutrain_parallel_tp.comm import copy_to_tp_region, reduce_from_tp_region
from blutrain_parallel_tp.overlap import check_chunks, column_parallel_linear, row_parallel_linear


@dataclass(frozen=True)
class Shard:
    """How a parameter is cut over a group of ``size``: along ``dim``, in ``parts`` equal blocks that
    are each split (c_attn's q, k and v are split separately, so each rank keeps whole heads)."""

    dim: int
    parts: int = 1


def _divisible(where: str, what: str, n: int, size: int) -> int:
    if n % size:
        raise DistArgumentError(f"{where}: {what} ({n}) must be divisible by the tensor-parallel size {size}")
    return n // size


def slice_shard(full: Tensor, shard: Shard, rank: int, size: int) -> Tensor:
    """This rank's block of the full tensor, contiguous."""
    n = full.shape[shard.dim]
    if n % (shard.parts * size):
        raise DistArgumentError(f"slice_shard: dim {shard.dim} of shape {list(full.shape)} must split into "
                                f"{shard.parts} part(s) of {size} equal blocks (the tensor-parallel size)")
    part_len = n // shard.parts
    block = part_len // size
    pieces = [full.narrow(shard.dim, p * part_len + rank * block, block) for p in range(shard.parts)]
    out = pieces[0] if len(pieces) == 1 else cat(pieces, dim=shard.dim)
    return out.detach().contiguous().clone()


def full_shape(local: tuple[int, ...], shard: Shard, size: int) -> tuple[int, ...]:
    """The full tensor's shape from one rank's block of it."""
    return (*local[:shard.dim], local[shard.dim] * size, *local[shard.dim + 1:])


def shard_range(full: tuple[int, ...], shard: Shard, rank: int, size: int) -> tuple[int, ...]:
    """The elements of the flattened full tensor that this rank's block holds, as a
    :class:`blutrain.dist.StateShard` range: ``(start, stop)`` of the first contiguous run, then
    ``(step, count)`` for the runs repeated over the dims before ``shard.dim`` and over the parts; in
    the order of the block flattened, so ``slice_shard(...).reshape(-1)`` is the range's piece."""
    outer = math.prod(full[:shard.dim])
    n = full[shard.dim]
    inner = math.prod(full[shard.dim + 1:])
    part_len = n // shard.parts
    block = part_len // size
    start = rank * block * inner
    out: tuple[int, ...] = (start, start + block * inner)
    if outer > 1:
        out += (n * inner, outer)
    if shard.parts > 1:
        out += (part_len * inner, shard.parts)
    return out


def gather_shard(local: Tensor, shard: Shard, group: ProcessGroup) -> Tensor:
    """The full tensor from every rank's block (collective over ``group``)."""
    if group.size == 1:
        return local.detach().clone()
    with no_grad():
        moved = local.detach().movedim(shard.dim, 0).contiguous()
        out = empty(group.size * moved.shape[0], *moved.shape[1:], dtype=moved.dtype, device=moved.device)
        group.all_gather_into_tensor(out, moved)
        # (size, parts, block, ...) → (parts, size, block, ...): each part's blocks side by side again
        block = moved.shape[0] // shard.parts
        rest = tuple(moved.shape[1:])
        full = out.reshape(group.size, shard.parts, block, *rest).transpose(0, 1).reshape(-1, *rest)
        return full.movedim(0, shard.dim).contiguous()


class ColumnParallelLinear(Module):
    """``out_features`` split over ``group``: this rank computes ``out_features / size`` of them."""

    weight: Parameter
    bias: Parameter | None

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup, bias: bool = True,
                 parts: int = 1, async_chunks: int = 0) -> None:
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.shard = Shard(0, parts)
        # 0: copy_to_tp_region then linear; k >= 1: the fused op, the input gradient reduced in k blocks
        self.async_chunks = check_chunks("ColumnParallelLinear", async_chunks) if async_chunks else 0
        local = _divisible("ColumnParallelLinear", f"out_features / parts ({out_features} / {parts})",
                           out_features // parts, group.size) * parts
        bound = 1.0 / math.sqrt(in_features)  # Linear's initialisation; from_linear replaces it
        self.weight = Parameter(init.uniform_(empty(local, in_features), -bound, bound))
        if bias:
            self.bias = Parameter(init.uniform_(empty(local), -bound, bound))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, full: Linear, group: ProcessGroup, parts: int = 1,
                    async_chunks: int = 0) -> ColumnParallelLinear:
        """This rank's rows of ``full`` (``parts`` > 1: of each of its ``parts`` row blocks)."""
        m = cls(full.in_features, full.out_features, group, full.bias is not None, parts, async_chunks)
        m.weight = Parameter(slice_shard(full.weight, m.shard, group.rank, group.size))
        if full.bias is not None:
            m.bias = Parameter(slice_shard(full.bias, m.shard, group.rank, group.size))
        return m

    def forward(self, x: Tensor) -> Tensor:
        if self.async_chunks and self.group.size > 1:
            return column_parallel_linear(x, self.weight, self.bias, self.group, self.async_chunks)
        return linear(copy_to_tp_region(x, self.group), self.weight, self.bias)

    def shards(self) -> dict[str, Shard]:
        return {"weight": self.shard, **({"bias": self.shard} if self.bias is not None else {})}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.weight.shape[0]}), bias={self.bias is not None}, tp={self.group.size}"
                + (f", async_chunks={self.async_chunks}" if self.async_chunks else ""))


class RowParallelLinear(Module):
    """``in_features`` split over ``group``: the input arrives split, the output is summed over ranks."""

    weight: Parameter
    bias: Parameter | None

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup, bias: bool = True,
                 async_chunks: int = 0) -> None:
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.shard = Shard(1)
        # 0: linear then reduce_from_tp_region; k >= 1: the fused op, the output reduced in k blocks
        self.async_chunks = check_chunks("RowParallelLinear", async_chunks) if async_chunks else 0
        local = _divisible("RowParallelLinear", "in_features", in_features, group.size)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = Parameter(init.uniform_(empty(out_features, local), -bound, bound))
        if bias:
            self.bias = Parameter(init.uniform_(empty(out_features), -bound, bound))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, full: Linear, group: ProcessGroup, async_chunks: int = 0) -> RowParallelLinear:
        """This rank's columns of ``full``; the bias whole (it is added once, after the sum)."""
        m = cls(full.in_features, full.out_features, group, full.bias is not None, async_chunks)
        m.weight = Parameter(slice_shard(full.weight, m.shard, group.rank, group.size))
        if full.bias is not None:
            m.bias = Parameter(full.bias.detach().clone())
        return m

    def forward(self, x: Tensor) -> Tensor:
        if self.async_chunks and self.group.size > 1:
            y = row_parallel_linear(x, self.weight, self.group, self.async_chunks)
        else:
            y = reduce_from_tp_region(linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def shards(self) -> dict[str, Shard]:
        return {"weight": self.shard}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.group.size}"
                + (f", async_chunks={self.async_chunks}" if self.async_chunks else ""))


class VocabParallelEmbedding(Module):
    """Rows ``vocab_start .. vocab_start + num_embeddings / size`` of the table on this rank."""

    weight: Parameter

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard = Shard(0)
        self.per_rank = _divisible("VocabParallelEmbedding", "num_embeddings (the vocabulary size)",
                                   num_embeddings, group.size)
        self.vocab_start = group.rank * self.per_rank
        self.weight = Parameter(init.normal_(empty(self.per_rank, embedding_dim)))

    @classmethod
    def from_embedding(cls, full: Embedding, group: ProcessGroup) -> VocabParallelEmbedding:
        m = cls(full.num_embeddings, full.embedding_dim, group)
        m.weight = Parameter(slice_shard(full.weight, m.shard, group.rank, group.size))
        return m

    def forward(self, idx: Tensor) -> Tensor:
        if self.group.size == 1:
            return embedding(idx, self.weight)
        local = idx - self.vocab_start
        outside = logical_or(local < 0, local >= self.per_rank)
        rows = embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def shards(self) -> dict[str, Shard]:
        return {"weight": self.shard}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, this rank: rows {self.vocab_start}.."
                f"{self.vocab_start + self.per_rank}, tp={self.group.size}")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "Shard", "VocabParallelEmbedding", "full_shape",
           "gather_shard", "shard_range", "slice_shard"]
