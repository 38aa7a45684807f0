"""Indexing: ``x[key]`` and ``x[key] = v``, index_select, gather, scatter_add, index_add, tril/triu.

Basic keys (ints, slices with a positive step, None, Ellipsis) make views; keys holding integer or
boolean tensors (or lists) gather into a new tensor, as in PyTorch and NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from blutrain.tensor import dispatch
from blutrain.tensor.base import Scalar, TensorBase, _normalize_dim
from blutrain.tensor.checks import check_index_range, check_key
from blutrain.tensor.dtype import bool_, int64
from blutrain.tensor.errors import (
    DeviceMismatchError,
    ShapeError,
    TensorTypeError,
    TensorValueError,
)
from blutrain.tensor.ops import elementwise as ew

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

_grad_mode = dispatch.grad_mode
_kernel = dispatch.kernel


def _parse_key(x: Tensor, key: Any) -> tuple[tuple[Any, ...], bool]:
    """The key as a tuple of backend-ready items, and whether it is advanced (gathering) indexing."""
    items = key if isinstance(key, tuple) else (key,)
    out: list[Any] = []
    advanced = False
    for item in items:
        if isinstance(item, TensorBase):
            if item.device is not x.device:
                raise DeviceMismatchError(f"index: index tensor is on {item.device}, indexed tensor on {x.device}")
            if item.dtype is not bool_ and item.dtype.is_floating:
                raise TensorTypeError(f"index: tensors used as indices must be integer or bool, got {item.dtype.name}")
            if item.ndim == 0 and item.dtype is not bool_:
                out.append(int(item.item()))
                continue
            out.append(item.array)
            advanced = True
        elif isinstance(item, (list, np.ndarray)):
            arr = np.asarray(item)
            if arr.dtype.kind not in "iub":
                raise TensorTypeError(f"index: lists used as indices must hold ints or bools, got {item!r}")
            out.append(x.device.backend.from_host(arr, x.device.index) if x.device.type != "cpu" else arr)
            advanced = True
        elif isinstance(item, slice):
            if item.step is not None and item.step <= 0:
                raise TensorValueError(f"index: slice step must be positive, got {item.step}")
            out.append(item)
        elif item is None or item is Ellipsis or (isinstance(item, int) and not isinstance(item, bool)):
            out.append(item)
        elif isinstance(item, bool):
            out.append(item)
            advanced = True
        else:
            raise TensorTypeError(f"index: unsupported index {item!r} of type {type(item).__name__}; expected "
                                  "int, slice, None, Ellipsis, or an integer/bool Tensor")
    check_key("index", x.shape, out, arrays=x.device.type == "cpu")
    return tuple(out), advanced


def getitem(x: Tensor, key: Any) -> Tensor:
    items, advanced = _parse_key(x, key)
    if not advanced:
        if Ellipsis not in items:
            items += (Ellipsis,)  # NumPy returns a scalar copy, not a 0-d view, for a full integer key
        return x._view_op("slice", x.array[items], {"shape": x.shape, "key": items})
    out = x._make(_kernel("index", x.device.type, x.dtype)(x.array, items), x.dtype, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("index", (x,), out, {"shape": x.shape, "key": items})
    return out


def setitem(x: Tensor, key: Any, value: Tensor | Scalar) -> None:
    """``x[key] = value`` in place (bumps the version counter)."""
    ew._check_inplace("setitem (x[key] = value)", x, value)
    ew.check_writable("setitem (x[key] = value)", x)
    items, _ = _parse_key(x, key)
    if isinstance(value, TensorBase):
        if value.device is not x.device:
            raise DeviceMismatchError(f"setitem: value is on {value.device}, target on {x.device}")
        v: Any = value.array if value.dtype is x.dtype else value.array.astype(x.dtype.np)
    elif isinstance(value, (bool, int, float)):
        v = value
    else:
        raise TensorTypeError(f"setitem: value must be a Tensor or a Python scalar, got {type(value).__name__}")
    try:
        _kernel("index_put", x.device.type, x.dtype)(x.array, items, v, False)
    except ValueError as exc:
        raise ShapeError(f"setitem: value of shape {list(getattr(value, 'shape', ()))} does not fit the "
                         f"indexed region of a tensor of shape {list(x.shape)}: {exc}") from None
    x.storage.version += 1


def index_put_(x: Tensor, indices: tuple[Tensor, ...], values: Tensor, accumulate: bool = False) -> Tensor:
    """``x[indices] = values`` (or ``+=`` with accumulate, summing repeated indices)."""
    ew._check_inplace("index_put_", x, values)
    ew.check_writable("index_put_", x)
    if not isinstance(values, TensorBase):
        raise TensorTypeError(f"index_put_: values must be a Tensor, got {type(values).__name__}")
    if values.device is not x.device:
        raise DeviceMismatchError(f"index_put_: values are on {values.device}, target on {x.device}")
    items, _ = _parse_key(x, tuple(indices))
    _kernel("index_put", x.device.type, x.dtype)(x.array, items, values.array.astype(x.dtype.np), accumulate)
    x.storage.version += 1
    return x


def _index_tensor(index: Tensor, x: Tensor, op: str, argument: str = "index", indexed: str = "input") -> None:
    if not isinstance(index, TensorBase) or index.dtype.is_floating or index.dtype is bool_:
        got = index.dtype.name if isinstance(index, TensorBase) else type(index).__name__
        raise TensorTypeError(f"{op}: {argument} must be an integer Tensor, got {got}")
    if index.device is not x.device:
        raise DeviceMismatchError(f"{op}: {argument} is on {index.device}, {indexed} on {x.device}")


def _check_bounds(op: str, index: Tensor, size: int, dim: int | None, of: str = "input",
                  argument: str = "index") -> None:
    """Index values in range, read on the CPU only (elsewhere the debug mode checks them)."""
    if index.device.type == "cpu":
        check_index_range(op, argument, index.array, size, dim, of)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    _index_tensor(index, x, "index_select")
    if index.ndim > 1:
        raise ShapeError(f"index_select: index must be 1-D, got shape {list(index.shape)}")
    d = _normalize_dim(dim, x.ndim)
    _check_bounds("index_select", index, x.shape[d] if x.ndim else 1, d)
    out = x._make(_kernel("index_select", x.device.type, x.dtype)(x.array, d, index.array), x.dtype, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("index_select", (x,), out, {"dim": d, "index": index, "shape": x.shape})
    return out


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    _index_tensor(index, x, "gather")
    d = _normalize_dim(dim, x.ndim)
    if index.ndim != x.ndim:
        raise ShapeError(f"gather: index must have as many dims as input ({x.ndim}), got shape {list(index.shape)}")
    for i, (si, sx) in enumerate(zip(index.shape, x.shape, strict=True)):
        if i != d and si > sx:
            raise ShapeError(f"gather: index shape {list(index.shape)} exceeds input shape {list(x.shape)} at dim {i}")
    _check_bounds("gather", index, x.shape[d], d)
    out = x._make(_kernel("gather", x.device.type, x.dtype)(x.array, d, index.array), x.dtype, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("gather", (x,), out, {"dim": d, "index": index, "shape": x.shape})
    return out


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """A copy of ``x`` with ``src`` added at ``index`` along ``dim`` (repeated indices sum)."""
    _index_tensor(index, x, "scatter_add")
    d = _normalize_dim(dim, x.ndim)
    if index.shape != src.shape or index.ndim != x.ndim:
        raise ShapeError(f"scatter_add: index {list(index.shape)} and src {list(src.shape)} must have the same "
                         f"shape, with as many dims as input {list(x.shape)}")
    _check_bounds("scatter_add", index, x.shape[d], d)
    dt = x.dtype
    out = x._make(_kernel("scatter_add", x.device.type, dt)(x.array, d, index.array,
                                                                 src.array.astype(dt.np)), dt, x.device)
    if _grad_mode.enabled and (x._rg or src._rg) and dispatch.recorder is not None:
        dispatch.recorder("scatter_add", (x, src), out, {"dim": d, "index": index})
    return out


def index_add(x: Tensor, dim: int, index: Tensor, source: Tensor, *, alpha: Scalar = 1) -> Tensor:
    """A copy of ``x`` with ``alpha * source`` slices added at ``index`` along ``dim``."""
    _index_tensor(index, x, "index_add")
    d = _normalize_dim(dim, x.ndim)
    if index.ndim != 1 or source.ndim != x.ndim or source.shape[d] != index.shape[0]:
        raise ShapeError(f"index_add: index must be 1-D with source.shape[{d}] entries; got index "
                         f"{list(index.shape)}, source {list(source.shape)}, input {list(x.shape)}")
    _check_bounds("index_add", index, x.shape[d], d)
    if alpha != 1:
        source = source * alpha
    out = x._make(_kernel("index_add", x.device.type, x.dtype)(x.array, d, index.array,
                                                                    source.array.astype(x.dtype.np)),
                       x.dtype, x.device)
    if _grad_mode.enabled and (x._rg or source._rg) and dispatch.recorder is not None:
        dispatch.recorder("index_add", (x, source), out, {"dim": d, "index": index})
    return out


def _tri(op: str, x: Tensor, diagonal: int) -> Tensor:
    if x.ndim < 2:
        raise ShapeError(f"{op}: expects at least 2 dims, got shape {list(x.shape)}")
    out = x._make(_kernel(op, x.device.type, x.dtype)(x.array, diagonal), x.dtype, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder(op, (x,), out, {"diagonal": diagonal})
    return out


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    return _tri("tril", x, diagonal)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    return _tri("triu", x, diagonal)


def one_hot(index: Tensor, num_classes: int) -> Tensor:
    """int64 one-hot encoding of an integer tensor along a new last dim."""
    if index.dtype.is_floating or index.dtype is bool_:
        raise TensorTypeError(f"one_hot: expected an integer tensor, got {index.dtype.name}")
    _check_bounds("one_hot", index, num_classes, None, "num_classes", "input")
    classes = index._make(_kernel("arange", index.device.type, int64)(0, num_classes, 1, int64.np), int64,
                          index.device)
    return ew.binary("eq", index.unsqueeze(-1), classes).to(dtype=int64)
