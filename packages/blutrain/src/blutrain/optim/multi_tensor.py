"""Multi-tensor kernels: one dispatched call updates whole lists of tensors in place.

An optimizer step is the same few arithmetic lines applied to every parameter. Handing the kernel
lists (parameters, gradients, state) instead of calling one op per tensor per line lets a device
backend do the whole step in one launch (a CUDA multi-tensor-apply kernel), while the CPU kernel
loops over NumPy arrays with in-place ufuncs. The kernel is found like any op: by (name, device
type, dtype) in the kernel table, so a plugin can replace it for one device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from blutrain.optim.errors import OptimizerError
from blutrain.tensor import Tensor, dispatch
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType


def group_by_device_dtype(tensors: Iterable[Tensor]) -> dict[tuple[Device, DType], list[int]]:
    """Indices of ``tensors`` per (device, dtype): one kernel call can take each bucket."""
    buckets: dict[tuple[Device, DType], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    return buckets


def multi_tensor_apply(op: str, tensor_lists: Sequence[Sequence[Tensor]], *scalars: Any,
                       written: Sequence[int]) -> Any:
    """Call kernel ``op`` once with the backend arrays of every list, then the scalars.

    Every tensor must share the first one's device and dtype (use :func:`group_by_device_dtype`).
    The kernel writes the lists at positions ``written`` in place; their version counters are
    bumped so that autograd notices a graph that saved one of them.
    """
    head = tensor_lists[0]
    if not head:
        return None
    dev, dt = head[0].device, head[0].dtype
    for lst in tensor_lists:
        for t in lst:
            if t.device is not dev or t.dtype is not dt:
                raise OptimizerError(f"{op}: every tensor must be on {dev} with dtype {dt.name}, got one on "
                                     f"{t.device} with dtype {t.dtype.name}")
    fn = dispatch.kernel(op, dev.type, dt)
    out = fn(*[[t._data for t in lst] for lst in tensor_lists], *scalars)
    for i in written:
        for t in tensor_lists[i]:
            t._bump_version()
    return out


__all__ = ["group_by_device_dtype", "multi_tensor_apply"]
