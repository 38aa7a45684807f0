"""Data parallelism: every rank holds the whole model, gradients are averaged across the group.

Gradients are grouped into :class:`GradBucket` s of about ``bucket_cap_mb`` (default 25 MiB), filled in
reverse parameter order (the order backward produces them). Each parameter's post-accumulate-grad
hook marks its gradient ready; when every gradient of a bucket is, they are all-reduced (average) in
place, as one coalesced operation (:func:`blutrain.dist.all_reduce_coalesced`: one grouped NCCL launch)
with ``async_op=True`` while backward goes on, buckets always launched in index order so every rank
issues the same collectives in the same order. No gradient is copied into a flat buffer and back. The
hook of the last gradient orders the stream after every bucket: when ``backward()`` returns the
gradients are synchronized.

``grad_dtype`` (``"bf16"``/``"fp16"``, default: the gradients' own dtype) sends a bucket in that dtype: its
gradients are cast into one flat buffer of that dtype (a kernel's result, so a compiled step can hold it), the
average is taken there, and once backward is done each float32 gradient is overwritten with the reduced values
widened again. The gradients the optimizer reads stay float32; half the bytes go over the wire, at the price of
one bf16 rounding of each rank's gradient and of the sum.

``no_sync()`` skips all of this (gradient accumulation: the sum stays local until the first
backward outside it). At construction, rank 0's parameters and buffers are broadcast to all ranks.

Compile (``blutrain.compiler``): the group is declared with :func:`blutrain.dist.traceable`, so each bucket's
all-reduce is recorded into a compiled training step where the hook issued it. The hooks hold no
value-dependent choices, and the gradients they reduce are made by the step's kernels, so every call issues the
same all-reduces on the same buffers. Nothing reads a bucket's gradients between its all-reduce and the end of
backward (the low-precision copy-back waits for ``_finish``), so on CUDA the compiled step runs each reduction
on the communication stream under the rest of backward, inside its one graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from blutrain.autograd import no_grad
from blutrain.dist import (
    DeviceMesh,
    DistArgumentError,
    DistError,
    ProcessGroup,
    Work,
    all_reduce_coalesced,
    get_process_group,
    traceable,
)
from blutrain.nn import Module
from blutrain.tensor import DType, Tensor, as_dtype, cat

DEFAULT_BUCKET_CAP_MB = 25.0
# --parallel ddp,grad_dtype=NAME: the names a user may give, and the dtype each means
GRAD_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


class GradBucket:
    """Parameters of one device and dtype whose gradients are reduced together, as one coalesced all-reduce
    of the gradients where they lie."""

    def __init__(self, index: int, params: list[tuple[str, Tensor]]) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work: Work | None = None
        self.sent: Tensor | None = None  # the flat low-precision copy in flight (grad_dtype), else None

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None
        self.sent = None

    def launch(self, group: ProcessGroup, comm_dtype: DType | None) -> None:
        """Start the average of this bucket's gradients: in place, or through a flat ``comm_dtype`` copy."""
        grads: list[Tensor] = [p.grad for p in self.params]  # type: ignore[misc]
        if comm_dtype is None or comm_dtype is grads[0].dtype:
            self.work = all_reduce_coalesced(group, grads, op="avg", async_op=True)
            return
        with no_grad():
            self.sent = cat([g.reshape(-1).to(dtype=comm_dtype) for g in grads])
        self.work = group.all_reduce(self.sent, op="avg", async_op=True)

    def finish(self) -> None:
        """Order the current stream after the bucket's average and, for a flat copy, widen it back into the
        gradients."""
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


def _buckets(params: list[tuple[str, Tensor]], cap_bytes: int) -> list[GradBucket]:
    """Reverse order, one (device, dtype) per bucket, a new bucket once ``cap_bytes`` is reached."""
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


class DistributedDataParallel(Module):
    """Wrap ``module`` so that ``backward()`` leaves every rank with the group-average gradient.

    ``group``: the data-parallel process group (default: the default group). ``bucket_cap_mb``:
    the size at which a bucket is closed and reduced. ``broadcast_parameters``: start from rank 0's
    parameters and buffers. ``grad_dtype``: the dtype gradients travel in (see the module doc; a key of
    :data:`GRAD_DTYPES`, default the gradients' own). Every parameter that requires grad must get a gradient
    in each synchronized backward (an unused one is reported at the next forward).
    """

    def __init__(self, module: Module, group: ProcessGroup | None = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, broadcast_parameters: bool = True,
                 grad_dtype: str | None = None) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise DistArgumentError(f"DistributedDataParallel: module must be a blutrain.nn.Module, got "
                                    f"{type(module).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise DistArgumentError(f"DistributedDataParallel: bucket_cap_mb must be a number > 0, got "
                                    f"{bucket_cap_mb!r}")
        if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
            raise DistArgumentError(f"DistributedDataParallel: grad_dtype must be one of {', '.join(GRAD_DTYPES)}, "
                                    f"got {grad_dtype!r}")
        self.module = module
        self.comm_dtype: DType | None = None if grad_dtype is None else as_dtype(GRAD_DTYPES[grad_dtype])
        self.group: ProcessGroup = traceable(get_process_group() if group is None else group)
        self.bucket_cap_mb = float(bucket_cap_mb)
        params: list[tuple[str, Tensor]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.buckets: list[GradBucket] = _buckets(params, int(self.bucket_cap_mb * 2**20)) if params else []
        self._sync = True
        self._launched = 0  # buckets launched in this backward pass, always a prefix of self.buckets
        if broadcast_parameters:
            self._broadcast_state()
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(bucket, i))

    # ----------------------------------------------------------------------------- set-up
    def _broadcast_state(self) -> None:
        """Rank 0's parameters and buffers to every rank."""
        if self.group.size == 1:
            return
        with no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                data = t.detach()
                if data.is_contiguous():
                    self.group.broadcast(data, src=0)
                else:  # collectives take contiguous memory
                    whole = data.contiguous()
                    self.group.broadcast(whole, src=0)
                    data.copy_(whole)

    # ----------------------------------------------------------------------------- backward
    def _hook(self, bucket: GradBucket, i: int) -> Any:
        def on_grad(p: Tensor) -> None:
            if not self._sync:
                return
            if bucket.ready[i]:
                raise DistError(f"DistributedDataParallel: parameter {bucket.names[i]!r} got a second gradient in "
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
        while self._launched < len(buckets) and buckets[self._launched].pending == 0:
            buckets[self._launched].launch(self.group, self.comm_dtype)
            self._launched += 1
        if self._launched == len(buckets):
            self._finish()

    def _finish(self) -> None:
        """Order the current stream after every bucket's reduction (and widen the low-precision ones back)."""
        for bucket in self.buckets:
            bucket.finish()
        self._launched = 0

    # ----------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync and (self._launched or any(b.pending != len(b.params) for b in self.buckets)):
            missing = [n for b in self.buckets for n, ok in zip(b.names, b.ready, strict=True) if not ok]
            raise DistError("DistributedDataParallel: the previous backward pass did not produce gradients for "
                            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; every parameter that "
                            "requires grad must take part in the loss (or set requires_grad=False on it)")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def extra_repr(self) -> str:
        sent = "" if self.comm_dtype is None else f", grad_dtype={self.comm_dtype.name}"
        return (f"group={self.group.backend} rank {self.group.rank}/{self.group.size}, buckets={len(self.buckets)}, "
                f"bucket_cap_mb={self.bucket_cap_mb:g}{sent}")


class DDP:
    """The "ddp" parallelism mode: ``DDP(mesh).wrap_model(model)`` over the mesh's "dp" dimension
    (dp × cp where the mesh has a "cp" dimension), or a process group itself; the optimizer is unchanged."""

    dim = "dp"
    compiles = True  # its group is declared with blutrain.dist.traceable (see the module doc)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, grad_dtype: str | None = None) -> None:
        if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
            raise DistArgumentError(f"ddp: grad_dtype must be one of {', '.join(GRAD_DTYPES)}, got {grad_dtype!r}")
        if isinstance(mesh, DeviceMesh):
            # context-parallel ranks hold replicas too (each saw part of the sequence): average over dp × cp
            self.group = mesh.get_group(self.dim, "cp") if "cp" in mesh.names else mesh.get_group(self.dim)
        else:
            self.group = get_process_group() if mesh is None else mesh
        self.bucket_cap_mb = bucket_cap_mb
        self.grad_dtype = grad_dtype

    def wrap_model(self, model: Any) -> DistributedDataParallel:
        return DistributedDataParallel(model, self.group, self.bucket_cap_mb, grad_dtype=self.grad_dtype)

    def wrap_optimizer(self, optimizer: Any) -> Any:
        return optimizer


__all__ = ["DDP", "DEFAULT_BUCKET_CAP_MB", "GRAD_DTYPES", "DistributedDataParallel", "GradBucket"]
