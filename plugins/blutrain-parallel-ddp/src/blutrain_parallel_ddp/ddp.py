"""Data parallelism: every rank holds the whole model, gradients are averaged across the group.

The averaging is :class:`blutrain.dist.GradientAverager`: gradients in buckets of about ``bucket_cap_mb``
(default 25 MiB), each all-reduced (average) as soon as backward has produced all of its gradients, overlapping
the rest of backward; when ``backward()`` returns the gradients are synchronized.

``grad_dtype`` (``"bf16"``/``"fp16"``, default: the gradients' own dtype) sends a bucket in that dtype: the
average is taken on a flat copy in that dtype and widened back into each float32 gradient once backward is done.
The gradients the optimizer reads stay float32; half the bytes go over the wire, at the price of one bf16 rounding
of each rank's gradient and of the sum.

``reduce`` (:data:`blutrain.dist.GRAD_REDUCTIONS`, default ``"backend"``: the comm backend's all-reduce)
``"ordered"`` sums each bucket over the ranks in rank order (:mod:`blutrain.dist.ordered_reduce`): the same
bytes on the wire as a ring all-reduce (an all-to-all, then an all-gather), plus an N-way local sum and a flat
copy and receive buffer per bucket in flight. With one micro-batch per rank and N a power of two, a float32
run's gradients are then bit-identical to one process accumulating the ranks' micro-batches in rank order, each
loss scaled by 1/N (what ``blutrain train`` does with gradient accumulation); a ring all-reduce's order of
additions differs from it by float32 rounding, which training amplifies. With several micro-batches per rank
(``no_sync``) it is the rank-ordered sum of each rank's own accumulation, not one process's order.

``no_sync()`` skips all of this (gradient accumulation: the sum stays local until the first
backward outside it). At construction, rank 0's parameters and buffers are broadcast to all ranks.

Compile (``blutrain.compiler``): the group is declared with :func:`blutrain.dist.traceable`, so each bucket's
all-reduce is recorded into a compiled training step where the hook issued it; on CUDA the compiled step runs
each reduction on the communication stream under the rest of backward, inside its one graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from blutrain.dist import (
    DEFAULT_BUCKET_CAP_MB,
    GRAD_REDUCTIONS,
    DeviceMesh,
    DistArgumentError,
    GradBucket,
    GradientAverager,
    ParallelMode,
    ProcessGroup,
    broadcast_from_rank0,
    check_reduction,
    get_process_group,
    traceable,
)
from blutrain.nn import Module
from blutrain.tensor import DType, Tensor, as_dtype

# --parallel ddp,grad_dtype=NAME: the names a user may give, and the dtype each means
GRAD_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


def comm_dtype(owner: str, grad_dtype: str | None) -> DType | None:
    """The dtype ``grad_dtype`` names (None: the gradients' own), or DistArgumentError from ``owner``."""
    if grad_dtype is None:
        return None
    if grad_dtype not in GRAD_DTYPES:
        raise DistArgumentError(f"{owner}: grad_dtype must be one of {', '.join(GRAD_DTYPES)}, got {grad_dtype!r}")
    return as_dtype(GRAD_DTYPES[grad_dtype])


class DistributedDataParallel(Module):
    """Wrap ``module`` so that ``backward()`` leaves every rank with the group-average gradient.

    ``group``: the data-parallel process group (default: the default group). ``bucket_cap_mb``:
    the size at which a bucket is closed and reduced. ``broadcast_parameters``: start from rank 0's
    parameters and buffers. ``grad_dtype``: the dtype gradients travel in (see the module doc; a key of
    :data:`GRAD_DTYPES`, default the gradients' own). ``reduce``: how each bucket is summed over the ranks, one
    of :data:`GRAD_REDUCTIONS` (see the module doc; default the backend's all-reduce). Every parameter that
    requires grad must get a gradient in each synchronized backward (an unused one is reported at the next
    forward).
    """

    def __init__(self, module: Module, group: ProcessGroup | None = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, broadcast_parameters: bool = True,
                 grad_dtype: str | None = None, reduce: str = "backend") -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise DistArgumentError(f"DistributedDataParallel: module must be a blutrain.nn.Module, got "
                                    f"{type(module).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise DistArgumentError(f"DistributedDataParallel: bucket_cap_mb must be a number > 0, got "
                                    f"{bucket_cap_mb!r}")
        self.comm_dtype = comm_dtype("DistributedDataParallel", grad_dtype)
        self.reduce = check_reduction("DistributedDataParallel", reduce)
        self.module = module
        self.group: ProcessGroup = traceable(get_process_group() if group is None else group)
        self.bucket_cap_mb = float(bucket_cap_mb)
        if broadcast_parameters:
            broadcast_from_rank0(self.group, [*module.parameters(), *module.buffers()])
        params: list[tuple[str, Tensor]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.averager = GradientAverager(params, self.group, self.bucket_cap_mb, self.comm_dtype,
                                         owner="DistributedDataParallel", reduce=self.reduce)

    @property
    def buckets(self) -> list[GradBucket]:
        return self.averager.buckets

    # ----------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.averager.check_previous_backward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        with self.averager.no_sync():
            yield

    def extra_repr(self) -> str:
        sent = "" if self.comm_dtype is None else f", grad_dtype={self.comm_dtype.name}"
        order = "" if self.reduce == "backend" else f", reduce={self.reduce}"
        return (f"group={self.group.backend} rank {self.group.rank}/{self.group.size}, buckets={len(self.buckets)}, "
                f"bucket_cap_mb={self.bucket_cap_mb:g}{sent}{order}")


class DDP(ParallelMode):
    """The "ddp" parallelism mode: ``DDP(mesh).wrap_model(model)`` over the mesh's "dp" dimension
    (dp × cp where the mesh has a "cp" dimension), or a process group itself; the optimizer is unchanged.
    The mesh form's ``grad_dtype=`` and ``reduce=`` set :attr:`grad_dtype` and :attr:`reduce`
    (``--parallel dp=2,grad_dtype=bf16``, ``--parallel dp=4,reduce=ordered``)."""

    dim = "dp"
    splits_batch = True  # each replica trains on its own rows of the batch
    compiles = True  # its group is declared with blutrain.dist.traceable (see the module doc)
    on_mesh = True
    mesh_order = 0  # outermost: replicas exchange gradients once per step
    mesh_options: ClassVar[Mapping[str, str]] = {"grad_dtype": "grad_dtype", "reduce": "reduce"}

    @classmethod
    def check_options(cls, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, grad_dtype: str | None = None,
                      reduce: str = "backend") -> None:
        comm_dtype("ddp", grad_dtype)
        check_reduction("ddp", reduce)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, grad_dtype: str | None = None,
                 reduce: str = "backend") -> None:
        self.check_options(bucket_cap_mb, grad_dtype, reduce)  # refused at once, before any model is built
        if isinstance(mesh, DeviceMesh):
            # context-parallel ranks hold replicas too (each saw part of the sequence): average over dp × cp
            self.group = mesh.get_group(self.dim, "cp") if "cp" in mesh.names else mesh.get_group(self.dim)
        else:
            self.group = get_process_group() if mesh is None else mesh
        self.bucket_cap_mb = bucket_cap_mb
        self.grad_dtype = grad_dtype
        self.reduce = reduce
        self.model: DistributedDataParallel | None = None

    def wrap_model(self, model: Any) -> DistributedDataParallel:
        self.model = DistributedDataParallel(model, self.group, self.bucket_cap_mb, grad_dtype=self.grad_dtype,
                                             reduce=self.reduce)
        return self.model

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync() if self.model is not None else contextlib.nullcontext()


__all__ = ["DDP", "DEFAULT_BUCKET_CAP_MB", "GRAD_DTYPES", "GRAD_REDUCTIONS", "DistributedDataParallel", "GradBucket"]
