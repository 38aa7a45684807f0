"""Gradient averaging across replicas, bucket by bucket while backward runs: what every mode whose ranks hold a
replica of the model (``ddp``, ``cp``'s sequence shards) uses.

Gradients are grouped into :class:`GradBucket` s of about ``bucket_cap_mb``, filled in reverse parameter order
(the order backward produces them), one device and dtype per bucket. Each parameter's post-accumulate-grad hook
marks its gradient ready; when every gradient of a bucket is, they are all-reduced (average) in place, as one
coalesced operation (:func:`blutrain.dist.all_reduce_coalesced`) with ``async_op=True`` while backward goes on,
buckets always launched in index order so every rank issues the same collectives in the same order. No gradient
is copied into a flat buffer and back (unless a ``comm_dtype`` or the ordered reduction asks for one, below).
The hook of the last gradient orders the stream after every bucket: when ``backward()`` returns the gradients
are synchronized.

``comm_dtype`` (default: the gradients' own dtype) sends a bucket in that dtype: its gradients are cast into one
flat buffer of that dtype (a kernel's result, so a compiled step can hold it), the average is taken there, and
once backward is done each gradient is overwritten with the reduced values widened again.

``reduce="ordered"`` averages each bucket in rank order (:mod:`blutrain.dist.ordered_reduce`): its gradients
are copied into one flat buffer padded to a multiple of the group size, exchanged by an ``all_to_all`` when
the bucket is ready, summed locally and all-gathered back when the next bucket is launched (so each
exchange runs under the backward of the next bucket), and copied back into the gradients once backward is
done. With one micro-batch per rank, the average is bit for bit what one process gets accumulating the ranks'
micro-batches in rank order with each loss scaled by 1/N, for N a power of two (see that module). Costs
beside the all-reduce: the same bytes on the wire, the flat copy and a receive buffer of the bucket's size
per bucket in flight, and an N-way sum.

Compile: the hooks hold no value-dependent choices and the gradients they reduce are made by the step's kernels,
so with a group declared by :func:`blutrain.dist.traceable` every call issues the same collectives on the same
buffers (the ordered reduction's sum is ordinary ops the trace records). Nothing reads a bucket's gradients
between its all-reduce and the end of backward (a flat copy's copy-back waits for
:meth:`GradientAverager.finish`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from blutrain.autograd import no_grad
from blutrain.dist.coalesced import all_reduce_coalesced
from blutrain.dist.errors import DistError
from blutrain.dist.ordered_reduce import OrderedReduction, check_reduction, padded_numel
from blutrain.dist.process_group import ProcessGroup, Work
from blutrain.tensor import DType, Tensor, cat, zeros

DEFAULT_BUCKET_CAP_MB = 25.0


class GradBucket:
    """Parameters of one device and dtype whose gradients are reduced together: as one coalesced all-reduce
    of the gradients where they lie, or through a flat copy (a ``comm_dtype``, or the rank-ordered
    reduction)."""

    def __init__(self, index: int, params: list[tuple[str, Tensor]]) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work: Work | None = None
        self.sent: Tensor | None = None  # the flat copy in flight (comm_dtype or ordered), else None
        self.ordered: OrderedReduction | None = None  # reduce="ordered": the reduction in flight

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None
        self.sent = None
        self.ordered = None

    def launch(self, group: ProcessGroup, comm_dtype: DType | None, reduce: str = "backend") -> None:
        """Start the average of this bucket's gradients: in place, or through a flat ``comm_dtype`` copy; with
        ``reduce="ordered"``, the rank-ordered reduction's exchange (:meth:`advance` sums and gathers)."""
        grads: list[Tensor] = [p.grad for p in self.params]  # type: ignore[misc]
        same = comm_dtype is None or comm_dtype is grads[0].dtype
        if reduce == "backend" and same:
            self.work = all_reduce_coalesced(group, grads, op="avg", async_op=True)
            return
        dtype = grads[0].dtype if comm_dtype is None else comm_dtype
        with no_grad():
            parts = [g.reshape(-1) if same else g.reshape(-1).to(dtype=dtype) for g in grads]
            if reduce == "ordered":
                numel = sum(g.numel() for g in grads)
                pad = padded_numel(numel, group.size) - numel
                if pad:
                    parts.append(zeros(pad, dtype=dtype, device=grads[0].device))
            self.sent = cat(parts)
        if reduce == "ordered":
            self.ordered = OrderedReduction(group, self.sent, op="avg")
        else:
            self.work = group.all_reduce(self.sent, op="avg", async_op=True)

    def advance(self) -> None:
        """The rank-ordered reduction's second step (its exchange waited for, this rank's chunk summed, the
        gather issued); nothing for an all-reduce."""
        if self.ordered is not None:
            self.ordered.reduce()

    def finish(self) -> None:
        """Order the current stream after the bucket's average and, for a flat copy, copy it back into the
        gradients (widened where it travelled in a lower precision)."""
        if self.ordered is not None:
            self.ordered.wait()
        else:
            assert self.work is not None
            self.work.wait()
        if self.sent is not None:
            with no_grad():
                offset = 0
                for p in self.params:
                    grad: Tensor = p.grad  # type: ignore[assignment]
                    n = grad.numel()
                    grad.copy_(self.sent[offset:offset + n].reshape(*grad.shape))
                    offset += n
        self.reset()


def bucket_parameters(params: Sequence[tuple[str, Tensor]], cap_bytes: int) -> list[GradBucket]:
    """``params`` (named, in forward order) in buckets: reverse order, one (device, dtype) per bucket, a new
    bucket once ``cap_bytes`` is reached."""
    out: list[GradBucket] = []
    open_: dict[tuple[str, str], list[tuple[str, Tensor]]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for name, p in reversed(params):
        key = (str(p.device), p.dtype.name)
        open_.setdefault(key, []).append((name, p))
        sizes[key] = sizes.get(key, 0) + p.numel() * p.dtype.itemsize
        if sizes[key] >= cap_bytes:
            out.append(GradBucket(len(out), open_.pop(key)))
            sizes[key] = 0
    for group in open_.values():
        out.append(GradBucket(len(out), group))
    return out


class GradientAverager:
    """Averages the gradients of ``params`` (named, forward order, each requiring grad) over ``group`` during
    every backward pass, bucket by bucket (module doc). ``reduce``: "backend" (the comm backend's all-reduce) or
    "ordered" (summed in rank order; module doc). ``owner`` names the caller in error messages.

    Every parameter must get exactly one gradient in each synchronized backward: a second one raises at once, a
    missing one at :meth:`check_previous_backward` (call it before each forward).
    """

    def __init__(self, params: Sequence[tuple[str, Tensor]], group: ProcessGroup,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, comm_dtype: DType | None = None,
                 owner: str = "GradientAverager", reduce: str = "backend") -> None:
        self.group = group
        self.comm_dtype = comm_dtype
        self.reduce = check_reduction(owner, reduce)
        self.owner = owner
        self.buckets: list[GradBucket] = bucket_parameters(params, int(bucket_cap_mb * 2**20)) if params else []
        self.sync = True  # False inside no_sync(): gradients accumulate locally
        self.launched = 0  # buckets launched in this backward pass, always a prefix of self.buckets
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(bucket, i))

    def _hook(self, bucket: GradBucket, i: int) -> Callable[[Tensor], None]:
        def on_grad(p: Tensor) -> None:
            if not self.sync:
                return
            if bucket.ready[i]:
                raise DistError(f"{self.owner}: parameter {bucket.names[i]!r} got a second gradient in "
                                "one backward pass (reused module or retain_graph?); use no_sync() for all but the "
                                "last of several backward passes")
            grad = p.grad
            assert grad is not None
            if not grad.is_contiguous():  # reduced where it lies, and collectives take contiguous memory
                p.grad = grad.contiguous()
            bucket.ready[i] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

        return on_grad

    def _launch_ready(self) -> None:
        buckets = self.buckets
        while self.launched < len(buckets) and buckets[self.launched].pending == 0:
            buckets[self.launched].launch(self.group, self.comm_dtype, self.reduce)
            if self.launched:  # the previous bucket's exchange ran under this one's backward: sum and gather it
                buckets[self.launched - 1].advance()
            self.launched += 1
        if self.launched == len(buckets):
            self.finish()

    def finish(self) -> None:
        """Order the current stream after every bucket's reduction (and widen the low-precision ones back)."""
        for bucket in self.buckets:
            bucket.finish()
        self.launched = 0

    def check_previous_backward(self) -> None:
        """Raise :class:`DistError` naming the parameters the last synchronized backward gave no gradient."""
        if self.sync and (self.launched or any(b.pending != len(b.params) for b in self.buckets)):
            missing = [n for b in self.buckets for n, ok in zip(b.names, b.ready, strict=True) if not ok]
            raise DistError(f"{self.owner}: the previous backward pass did not produce gradients for "
                            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; every parameter that "
                            "requires grad must take part in the loss (or set requires_grad=False on it)")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


def broadcast_from_rank0(group: ProcessGroup, tensors: Sequence[Tensor]) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with rank 0's values (replicas start equal)."""
    if group.size == 1:
        return
    with no_grad():
        for t in tensors:
            data = t.detach()
            if data.is_contiguous():
                group.broadcast(data, src=0)
            else:  # collectives take contiguous memory
                whole = data.contiguous()
                group.broadcast(whole, src=0)
                data.copy_(whole)


__all__ = ["DEFAULT_BUCKET_CAP_MB", "GradBucket", "GradientAverager", "bucket_parameters", "broadcast_from_rank0"]
