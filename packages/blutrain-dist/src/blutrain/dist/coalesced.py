"""An all-reduce of several tensors as one operation, each reduced where it lies.

Data parallelism reduces its gradients a bucket at a time. Copying each gradient into a flat buffer and
back costs a read and a write of every gradient per step, and the buffer's memory; a backend that can
launch several reductions as one (NCCL's grouped calls) reduces the gradients in place instead. A group
with an ``all_reduce_coalesced`` method of its own (the nccl group; :class:`~blutrain.dist.TraceableGroup`,
which hands it to a compiler trace as one event) does that; on any other group each tensor is all-reduced
on its own, every one posted before any is waited for.
"""

from __future__ import annotations

from collections.abc import Sequence

from blutrain.tensor import Tensor

from blutrain.dist.errors import DistArgumentError
from blutrain.dist.exchange import WorkList
from blutrain.dist.process_group import ProcessGroup, ReduceOp, Work


def all_reduce_coalesced(group: ProcessGroup, tensors: Sequence[Tensor], op: ReduceOp = "sum",
                         async_op: bool = False) -> Work | None:
    """All-reduce every tensor of ``tensors`` in place over ``group`` (``op``: sum, avg or max), as one
    operation where the group can launch it so. ``async_op``: return one handle for all of them."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise DistArgumentError(f"all_reduce_coalesced: tensors must be a non-empty list of tensors, got "
                                f"{tensors!r}")
    own = getattr(group, "all_reduce_coalesced", None)
    if own is not None:
        result: Work | None = own(list(tensors), op, async_op=async_op)
        return result
    works = [group.all_reduce(t, op, async_op=True) for t in tensors]
    work = WorkList([w for w in works if w is not None])
    if async_op:
        return work
    work.wait()
    return None


__all__ = ["all_reduce_coalesced"]
