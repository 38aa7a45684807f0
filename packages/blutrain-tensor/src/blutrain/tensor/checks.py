"""Value checks on backend arrays: index ranges and NaN.

A shape, dtype or device is known on the host, so the ops check those on every call. A value
inside an array is not: reading one back (a min, a max, an ``isnan().any()``) costs a reduction,
and on an accelerator a synchronization as well. So the ops run the index checks here themselves
only on the CPU, where a reduction over an index tensor is cheap beside the kernel and NumPy would
otherwise wrap a negative index silently; on other devices the same checks run in the debug mode
(:mod:`blutrain.tensor.debug`), wrapped around the kernels. The NaN checks run only there.

Every function takes the array module of its argument, so one code path serves every device, and
raises with a message naming the op, the argument, what was expected and what was received.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blutrain.tensor.backend import array_module
from blutrain.tensor.errors import ShapeError, TensorIndexError, TensorValueError

Array = Any


def check_index_range(op: str, argument: str, index: Array, size: int, dim: int | None, of: str) -> None:
    """Every value of the integer array ``index`` lies in ``[0, size)``, the size of dim ``dim`` of
    the argument ``of`` (``dim`` None: ``size`` is the argument ``of`` itself, as num_classes)."""
    if not index.size:
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= size:
        bad = hi if hi >= size else lo
        where = f"{of}={size}" if dim is None else f"dim {dim} of {of} (size {size})"
        raise TensorIndexError(f"{op}: {argument} out of range: expected indices in [0, {size}) for {where}, "
                               f"received {bad}")


def check_class_targets(op: str, target: Array, num_classes: int, ignore_index: int) -> None:
    """Class indices in ``[0, num_classes)``, or ``ignore_index`` (which may lie anywhere)."""
    if not target.size:
        return
    xp = array_module(target)
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        first = int(target.reshape(-1)[int(xp.argmax(bad.reshape(-1)))])
        raise TensorIndexError(f"{op}: target out of range: expected class indices in [0, {num_classes}) or "
                               f"ignore_index={ignore_index}, received {first}")


def _is_mask(item: Any) -> bool:
    return hasattr(item, "dtype") and item.dtype.kind == "b"


def check_key(op: str, shape: Sequence[int], items: Sequence[Any], arrays: bool) -> None:
    """A parsed ``x[key]`` key fits ``shape``: integers in range, masks of the shape they cover, not
    too many indices; integer index arrays in ``[-size, size)`` too when ``arrays`` (their values
    must be read for that)."""
    ndim = len(shape)
    dim = 0
    for pos, item in enumerate(items):
        if item is Ellipsis:
            rest = sum(other.ndim if _is_mask(other) else 1 for other in items[pos + 1:] if other is not None)
            dim = ndim - rest
            continue
        if item is None:
            continue
        if isinstance(item, int) and not isinstance(item, bool):
            if dim >= ndim:
                raise TensorIndexError(f"{op}: too many indices for a tensor of shape {list(shape)}")
            size = shape[dim]
            if not -size <= item < size:
                raise TensorIndexError(f"{op}: index {item} is out of range for dim {dim} of size {size}: "
                                       f"expected an index in [{-size}, {size})")
        elif _is_mask(item):
            covered = tuple(shape[dim:dim + item.ndim])
            if tuple(item.shape) != covered:
                raise ShapeError(f"{op}: a bool mask of shape {list(item.shape)} must match the dims it indexes, "
                                 f"{list(covered)} (dims {dim}..{dim + item.ndim - 1} of shape {list(shape)})")
        elif arrays and hasattr(item, "dtype") and item.size:
            size = shape[dim] if dim < ndim else 0
            lo, hi = int(item.min()), int(item.max())
            if lo < -size or hi >= size:
                bad = hi if hi >= size else lo
                raise TensorIndexError(f"{op}: index {bad} is out of range for dim {dim} of size {size}: "
                                       f"expected indices in [{-size}, {size})")
        dim += item.ndim if _is_mask(item) else 1  # a mask spans its dims
    if dim > ndim:
        raise TensorIndexError(f"{op}: too many indices for a tensor of shape {list(shape)}")


def is_floating(array: Array) -> bool:
    """Whether an array holds floating values (bfloat16 is a NumPy "V" kind through ml_dtypes)."""
    kind = array.dtype.kind
    return bool(kind == "f" or (kind == "V" and array.dtype.name == "bfloat16"))


def check_no_nan(op: str, argument: str, array: Array | None) -> None:
    """A floating ``array`` holds no NaN (infinities are allowed: -inf is how masks are written)."""
    if array is None or not is_floating(array) or not array.size:
        return
    xp = array_module(array)
    nan = xp.isnan(array)
    if bool(nan.any()):
        count = int(nan.sum())
        first = tuple(int(i) for i in xp.unravel_index(int(xp.argmax(nan.reshape(-1))), array.shape))
        raise TensorValueError(f"{op}: {argument} holds NaN: expected no NaN, received {count} of {array.size} "
                               f"elements NaN (the first at {list(first)}) in a tensor of shape {list(array.shape)}")


__all__ = ["check_class_targets", "check_index_range", "check_key", "check_no_nan", "is_floating"]
