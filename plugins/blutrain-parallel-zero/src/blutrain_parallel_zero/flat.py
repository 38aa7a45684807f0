"""FlatBucket: parameters of one device and dtype laid end to end, sharded evenly over the ranks.

The bucket's elements are padded with zeros to a multiple of the group size ``n``; rank ``r`` owns
elements ``[r*s, (r+1)*s)`` with ``s = padded / n``. ``shard`` is the rank's master copy of those
parameter elements (what the optimizer updates) and ``shard_grad`` the group-average gradient of them.
Each parameter overlaps the owned range in at most one contiguous *segment*; the sharded optimizer
steps one view per segment, so parameter groups (weight decay on some tensors only) keep working.
"""

from __future__ import annotations

from blutrain.autograd import no_grad
from blutrain.tensor import Tensor, cat, zeros


class Segment:
    """The part ``[lo, hi)`` of parameter ``index``'s flattened elements that this rank owns, at
    ``[shard_lo, shard_lo + hi - lo)`` of its shard."""

    __slots__ = ("hi", "index", "lo", "shard_lo")

    def __init__(self, index: int, lo: int, hi: int, shard_lo: int) -> None:
        self.index, self.lo, self.hi, self.shard_lo = index, lo, hi, shard_lo

    @property
    def shard_hi(self) -> int:
        return self.shard_lo + self.hi - self.lo


class FlatBucket:
    """``params`` (name, tensor) of one device and dtype, flattened in order; ``rank`` of ``world``."""

    def __init__(self, index: int, params: list[tuple[str, Tensor]], rank: int, world: int) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.shard_numel = max(-(-total // world), 1)
        self.padded = self.shard_numel * world
        self.start = rank * self.shard_numel
        self.stop = self.start + self.shard_numel
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.shard = zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        self.shard_grad = zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        self.segments: list[Segment] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(off, self.start), min(off + n, self.stop)
            if lo < hi:
                self.segments.append(Segment(i, lo - off, hi - off, lo - self.start))

    def full_buffer(self) -> Tensor:
        """A buffer for the whole (padded) bucket, to gather into. Zeros rather than ``empty``: the kernel
        that fills it is what lets a compiled step make the buffer again on every call."""
        return zeros(self.padded, dtype=self.dtype, device=self.device)

    def view(self, full: Tensor, i: int) -> Tensor:
        """Parameter ``i`` as a view of a full (gathered) buffer."""
        return full[self.offsets[i]:self.offsets[i] + self.numels[i]].view(*self.shapes[i])

    def flatten(self, tensors: list[Tensor | None]) -> Tensor:
        """One padded flat buffer of ``tensors`` (one per parameter, None as zeros)."""
        with no_grad():
            parts = [t.detach().reshape(-1) if t is not None else zeros(n, dtype=self.dtype, device=self.device)
                     for t, n in zip(tensors, self.numels, strict=True)]
            if self.padded > self.numel:
                parts.append(zeros(self.padded - self.numel, dtype=self.dtype, device=self.device))
            return cat(parts).to(dtype=self.dtype)

    def owned(self, full: Tensor) -> Tensor:
        return full[self.start:self.stop]


__all__ = ["FlatBucket", "Segment"]
