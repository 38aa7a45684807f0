"""A reduction whose result does not depend on how the backend orders its additions: every element is summed
over the ranks in rank order, ``((x0 + x1) + x2) + ...``, as separate adds in the tensor's dtype.

Why: a ring all-reduce (NCCL) starts each chunk's sum at a different rank, so its float32 result differs from
one process that accumulates the same ranks' values in order by an ulp here and there; through training those
differences grow. Summed in rank order, a data-parallel step's gradient is, bit for bit, the one a single
process gets by accumulating the ranks' micro-batches in that order (autograd's ``.grad += g``).

The wire: a flat buffer of ``N × S`` values (padded to a multiple of the group size N) is seen as N chunks of
S; an ``all_to_all`` hands rank r every rank's chunk r (``N × S`` values received, in rank order), rank r sums
them locally (:func:`rank_ordered_sum`), and an ``all_gather_into_tensor`` of the reduced chunks makes the whole
reduced buffer on every rank: the bytes a ring all-reduce moves (its reduce-scatter and all-gather halves),
plus a receive buffer of the flat buffer's size and an N-way local sum. Without the gather it is a
reduce-scatter in rank order (:func:`ordered_reduce_scatter`).

Averages: the sum is divided by N after it is taken. For N a power of two that is exact, and equals summing
the values each scaled by 1/N first (scaling by a power of two commutes with rounding, barring subnormals): the
same bits as one process that scales each micro-batch's loss by ``1 / N`` and accumulates. For any other N the
division is the one rounding of the mean of the ordered sum; a process scaling each loss by a rounded ``1/N``
rounds differently, so bit-identity with it holds only for powers of two.

Every step is an ordinary collective of the group (a :func:`blutrain.dist.traceable` group records them into a
compiled step) or ordinary tensor ops (the sum: recorded by a trace like any kernel); the receive buffer is made
by a kernel (``zeros``), as a compiled step needs.
"""

from __future__ import annotations

from blutrain.autograd import no_grad
from blutrain.tensor import Tensor, zeros

from blutrain.dist.errors import DistArgumentError
from blutrain.dist.process_group import ProcessGroup, ReduceOp, Work

# the ways a data-parallel mode may reduce its gradients (``--parallel ddp,reduce=NAME``, ``zero=2,reduce=NAME``):
# "backend" the comm backend's own all-reduce or reduce-scatter (a ring on NCCL: the order of additions its own),
# "ordered" this module's
GRAD_REDUCTIONS = ("backend", "ordered")


def check_reduction(owner: str, reduce: object) -> str:
    """``reduce`` if it names one of :data:`GRAD_REDUCTIONS`, else :class:`DistArgumentError` from ``owner``."""
    if not isinstance(reduce, str) or reduce not in GRAD_REDUCTIONS:
        raise DistArgumentError(f"{owner}: reduce must be one of {', '.join(GRAD_REDUCTIONS)} (backend: the comm "
                                f"backend's own reduction; ordered: the ranks' gradients summed in rank order, as "
                                f"one process accumulates them), got {reduce!r}")
    return reduce


def padded_numel(numel: int, size: int) -> int:
    """``numel`` rounded up to a multiple of ``size`` (at least ``size``): a flat buffer split in ``size``
    equal chunks."""
    return max(-(-numel // size), 1) * size


def rank_ordered_sum(blocks: Tensor, size: int, op: ReduceOp = "sum") -> Tensor:
    """``blocks`` (1-d, ``size`` equal blocks: block r from rank r) reduced in rank order,
    ``((b0 + b1) + b2) + ...`` as separate adds, then divided by ``size`` for ``op="avg"`` (a group of one's
    sum is block 0 itself)."""
    if op not in ("sum", "avg"):
        raise DistArgumentError(f"rank_ordered_sum: op must be 'sum' or 'avg', got {op!r}")
    n = blocks.shape[0] // size
    with no_grad():
        total = blocks[0:n]
        for r in range(1, size):
            total = total + blocks[r * n:(r + 1) * n]
        return total / size if op == "avg" and size > 1 else total


class OrderedReduction:
    """The rank-ordered reduction of one flat buffer (``flat``: 1-d, its length a multiple of the group size),
    in three steps that a caller spreads over time so that communication overlaps compute:

    1. construction issues the ``all_to_all`` (``async_op=True``) into a receive buffer of ``flat``'s size;
    2. :meth:`reduce` waits for it and sums this rank's chunk in rank order (``chunk``: this rank's part of the
       result; ``scatter_only=True`` stops here, a reduce-scatter), then (unless ``scatter_only``) issues the
       ``all_gather_into_tensor`` of the chunks back into ``flat``;
    3. :meth:`wait` waits for the gather: ``flat`` holds the reduced buffer on every rank.

    Nothing may read or write ``flat`` between construction and :meth:`wait` (the collectives use it)."""

    def __init__(self, group: ProcessGroup, flat: Tensor, op: ReduceOp = "avg") -> None:
        size = group.size
        if flat.ndim != 1 or flat.shape[0] % size:
            raise DistArgumentError(f"OrderedReduction: flat must be 1-d with a length that is a multiple of the "
                                    f"group size {size}, got shape {list(flat.shape)}")
        self.group, self.flat, self.op = group, flat, op
        # made by a kernel, not empty(): a compiled step makes the buffer the collective writes again each call
        self.received: Tensor | None = zeros(flat.shape[0], dtype=flat.dtype, device=flat.device)
        self.work: Work | None = group.all_to_all(self.received, flat, async_op=True)
        self.chunk: Tensor | None = None
        self.gathering = False

    def reduce(self, scatter_only: bool = False) -> Tensor:
        """Step 2: this rank's chunk of the result (waiting for the exchange); unless ``scatter_only``, the
        gather of every rank's chunk into ``flat`` is issued. Idempotent."""
        if self.chunk is None:
            assert self.received is not None
            if self.work is not None:
                self.work.wait()
            self.chunk = rank_ordered_sum(self.received, self.group.size, self.op)
            self.received = None  # the receive buffer is let go as soon as it is summed
            self.work = None
        if not scatter_only and not self.gathering:
            self.work = self.group.all_gather_into_tensor(self.flat, self.chunk, async_op=True)
            self.gathering = True
        return self.chunk

    def wait(self) -> Tensor:
        """Step 3: ``flat``, reduced on every rank (runs the earlier steps first where they have not run)."""
        self.reduce()
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.flat


def ordered_reduce_scatter(group: ProcessGroup, output: Tensor, input: Tensor, op: ReduceOp = "avg") -> None:
    """A reduce-scatter summed in rank order: ``output`` (rank r) = block r of ``input`` reduced over the ranks
    as :func:`rank_ordered_sum` reduces (``input``: 1-d, ``size × output`` elements). Synchronous."""
    if input.ndim != 1 or output.ndim != 1 or input.shape[0] != output.shape[0] * group.size:
        raise DistArgumentError(f"ordered_reduce_scatter: input must be 1-d with {group.size} × output's elements, "
                                f"got input {list(input.shape)} and output {list(output.shape)}")
    with no_grad():
        output.copy_(OrderedReduction(group, input, op).reduce(scatter_only=True))


__all__ = ["GRAD_REDUCTIONS", "OrderedReduction", "check_reduction", "ordered_reduce_scatter", "padded_numel",
           "rank_ordered_sum"]
