"""Multi-tensor kernels: one dispatched call updates whole lists of tensors in place.

An optimizer step is the same few arithmetic lines applied to every parameter. Handing the kernel
lists (parameters, gradients, state) instead of calling one op per tensor per line lets a device
backend do the whole step in one launch (a CUDA multi-tensor-apply kernel), while the CPU kernel
loops over NumPy arrays with in-place ufuncs. The kernel is found like any op: by (name, device
type, dtype) in the kernel table, so a plugin can replace it for one device.

The numbers that change from step to step (the learning rate of a schedule, AdamW's bias
corrections) reach the kernel as a small float64 array in device memory (:class:`StepScalars`), not
as Python floats: a kernel launch bakes its Python arguments in, so a CUDA graph captured once
(``blutrain.compiler``) could not replay later steps, while an array is read when the kernel runs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from blutrain.optim.errors import OptimizerError
from blutrain.tensor import Tensor, capture, dispatch
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType


def group_by_device_dtype(tensors: Iterable[Tensor]) -> dict[tuple[Device, DType], list[int]]:
    """Indices of ``tensors`` per (device, dtype): one kernel call can take each bucket."""
    buckets: dict[tuple[Device, DType], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    return buckets


class StepScalars:
    """An optimizer's per-step kernel scalars in device memory: one float64 array per call site.

    ``scalars(site, device, values)`` returns the same array for ``site`` (any hashable naming what
    the kernels of one step read, e.g. (group index, bucket index)) on every step, with ``values``
    written into it from the host when they changed: the backend's ``write_from_host``, a copy into
    the array queued on the current stream after the kernels already queued there (which read the old
    values) and before those queued later, with no allocation and no wait for the device. Only the
    first call of a site, or one whose device or number of values changed, allocates the array. The
    array is a plain backend array, not a tensor: no op records the write, so under
    ``blutrain.compiler`` the array is graph state that the optimizer's Python, re-run on the host
    before each replay (``blutrain.tensor.capture.per_call``, outside any graph capture), refills
    ahead of the replay's launch on the same stream.

    A site must not be refilled with other values after a kernel of the same compiled call read it (a
    replay runs the kernels only, so all of them would read the last values): one optimizer step per
    compiled call. The compiler's trace refuses a function that does otherwise.
    """

    def __init__(self) -> None:
        # site → (device array, the values it holds, the host buffer the values are written from)
        self._buffers: dict[Hashable, tuple[Any, tuple[float, ...], np.ndarray[Any, Any]]] = {}

    def __call__(self, site: Hashable, device: Device, values: Sequence[float]) -> Any:
        host = tuple(float(v) for v in values)
        backend = device.backend
        entry = self._buffers.get(site)
        if entry is not None:
            array, held, staging = entry
            if len(held) == len(host) and type(array) is backend.array_type \
                    and backend.device_index(array) == device.index:
                if held != host:
                    staging[...] = host  # write_from_host returned last time: its host buffer may be reused
                    backend.write_from_host(array, staging)
                    self._buffers[site] = (array, host, staging)
                return array
        staging = np.array(host, np.float64)
        array = backend.from_host(staging, device.index)
        self._buffers[site] = (array, host, staging)
        return array


def multi_tensor_apply(op: str, tensor_lists: Sequence[Sequence[Tensor]], *scalars: Any,
                       written: Sequence[int]) -> Any:
    """Call kernel ``op`` once with the backend arrays of every list, then the scalars (Python numbers,
    or backend arrays such as a :class:`StepScalars` array, passed as they are).

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
    tracing = capture.active()
    if tracing is not None:  # written whatever the values: a scale by 1 at trace time still writes at replay
        starts = [0]
        for lst in tensor_lists:
            starts.append(starts[-1] + len(lst))
        tracing.declare_writes(tuple(j for i in written for j in range(starts[i], starts[i + 1])))
    out = fn(*[[t.array for t in lst] for lst in tensor_lists], *scalars)
    for i in written:
        for t in tensor_lists[i]:
            t.bump_version()
    return out


__all__ = ["StepScalars", "group_by_device_dtype", "multi_tensor_apply"]
