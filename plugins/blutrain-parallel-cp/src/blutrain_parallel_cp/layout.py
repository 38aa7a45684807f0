"""The load-balanced causal layout of a sequence over ``world`` context-parallel ranks.

The sequence is cut into ``2·world`` chunks and rank r holds chunks ``r`` and ``2·world - 1 - r``:
under a causal mask an early chunk attends to little and a late one to much, so pairing the r-th
earliest with the r-th latest gives every rank the same attention work (Megatron-LM's and
Llama 3's layout). Rank r's local sequence is its two chunks, early one first.
"""

from __future__ import annotations

from dataclasses import dataclass

from blutrain.dist import DistArgumentError
from blutrain.tensor import Tensor, arange, cat


@dataclass(frozen=True)
class ChunkLayout:
    """``seq_len`` positions over ``world`` ranks in ``2·world`` chunks of ``chunk`` positions."""

    seq_len: int
    world: int

    def __post_init__(self) -> None:
        for name in ("seq_len", "world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DistArgumentError(f"ChunkLayout: {name} must be an int >= 1, got {value!r}")
        if self.seq_len % (2 * self.world):
            raise DistArgumentError(f"ChunkLayout: the sequence length {self.seq_len} must be a multiple of "
                                    f"2·cp = {2 * self.world} (two chunks per context-parallel rank)")

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.world)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The chunk indices rank ``rank`` holds, in local order."""
        return rank, 2 * self.world - 1 - rank

    def positions(self, rank: int) -> list[int]:
        """The global positions of rank ``rank``'s local sequence."""
        return [c * self.chunk + i for c in self.chunks(rank) for i in range(self.chunk)]

    def order(self) -> list[int]:
        """Where each global position sits in the concatenation of every rank's local sequence
        (rank 0's first): ``gathered[order()]`` is the sequence in natural order."""
        where = [0] * self.seq_len
        local = 2 * self.chunk
        for r in range(self.world):
            for j, p in enumerate(self.positions(r)):
                where[p] = r * local + j
        return where

    def shard(self, x: Tensor, rank: int, dim: int = 1) -> Tensor:
        """Rank ``rank``'s two chunks of ``x`` along ``dim`` (the full sequence)."""
        if x.shape[dim] != self.seq_len:
            raise DistArgumentError(f"ChunkLayout.shard: dim {dim} of x must be the sequence length "
                                    f"{self.seq_len}, got shape {list(x.shape)}")
        a, b = self.chunks(rank)
        return cat([x.narrow(dim, a * self.chunk, self.chunk), x.narrow(dim, b * self.chunk, self.chunk)], dim=dim)

    def position_ids(self, rank: int, device: object = None) -> Tensor:
        """The global positions of rank ``rank``'s local sequence as an int64 tensor (two ``arange``
        kernels, so that a compiled step makes them again on every call)."""
        c = self.chunk
        return cat([arange(a * c, (a + 1) * c, dtype="int64", device=device)  # type: ignore[arg-type]
                    for a in self.chunks(rank)])

    def to_natural(self, x: Tensor, dim: int) -> Tensor:
        """``x`` whose ``dim`` is every rank's local sequence in turn (rank 0's first, as an all-to-all or
        all-gather leaves it) in natural order: ``x.index_select(dim, order())``, as slices of chunks."""
        c, local = self.chunk, 2 * self.chunk
        # chunk k is rank k's first (k < world) or rank 2·world - 1 - k's second
        starts = [k * local if k < self.world else (2 * self.world - 1 - k) * local + c for k in range(2 * self.world)]
        return cat([x.narrow(dim, s, c) for s in starts], dim=dim)

    def from_natural(self, x: Tensor, dim: int) -> Tensor:
        """The inverse of :meth:`to_natural`: every rank's local sequence in turn from the natural order."""
        c = self.chunk
        return cat([x.narrow(dim, a * c, c) for r in range(self.world) for a in self.chunks(r)], dim=dim)


__all__ = ["ChunkLayout"]
