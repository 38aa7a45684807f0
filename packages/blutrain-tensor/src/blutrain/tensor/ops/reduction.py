"""Reductions over dims (``dim``/``keepdim`` as in PyTorch) and the softmax family.

Half-precision inputs are accumulated in float32 by the kernels and written back in their dtype;
integer and bool sums accumulate in int64, as PyTorch does.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from blutrain.tensor import dispatch
from blutrain.tensor.autocast import state as autocast_state
from blutrain.tensor.autocast import widen
from blutrain.tensor.base import TensorBase
from blutrain.tensor.dtype import DType, as_dtype, bool_, int64
from blutrain.tensor.errors import TensorTypeError, TensorValueError

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

_grad_mode = dispatch.grad_mode
_kernel = dispatch.kernel


class ValuesIndices(NamedTuple):
    """What ``max(dim)``/``min(dim)`` return: the values and the int64 indices where they occur."""

    values: Tensor
    indices: Tensor


def normalize_dims(dim: int | Sequence[int] | None, ndim: int, op: str) -> tuple[int, ...] | None:
    """``None`` → every dim; an int or a sequence → sorted, non-negative, without duplicates."""
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    n = builtins.max(ndim, 1)
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not -n <= d < n:
            raise TensorValueError(f"{op}: dim must be in [{-n}, {n - 1}], got {dim!r}")
        out.append(d % n if ndim else 0)
    if len(set(out)) != len(out):
        raise TensorValueError(f"{op}: dim {dim!r} repeats a dimension")
    return tuple(sorted(out)) if ndim else None


def _record(op: str, x: Tensor, out: Tensor, attrs: dict[str, Any]) -> Tensor:
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder(op, (x,), out, attrs)
    return out


def _float_input(x: Tensor, op: str) -> None:
    if not x.dtype.is_floating:
        raise TensorTypeError(f"{op}: expected a floating tensor, got dtype {x.dtype.name}; convert with .float()")


def sum(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False, *,
        dtype: DType | str | None = None) -> Tensor:
    dims = normalize_dims(dim, x.ndim, "sum")
    dt = as_dtype(dtype) if dtype is not None else (x.dtype if x.dtype.is_floating else int64)
    data = x.array if dt is x.dtype else x.array.astype(dt.np)
    out = x._make(_kernel("sum", x.device.type, dt)(data, dims, keepdim), dt, x.device)
    return _record("sum", x, out, {"dims": dims, "keepdim": keepdim, "shape": x.shape})


def mean(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    _float_input(x, "mean")
    dims = normalize_dims(dim, x.ndim, "mean")
    out = x._make(_kernel("mean", x.device.type, x.dtype)(x.array, dims, keepdim), x.dtype, x.device)
    return _record("mean", x, out, {"dims": dims, "keepdim": keepdim, "shape": x.shape})


def _extreme(op: str, x: Tensor, dim: int | Sequence[int] | None, keepdim: bool) -> Tensor:
    dims = normalize_dims(dim, x.ndim, op)
    if x.numel() == 0 and (dims is None or builtins.any(x.shape[d] == 0 for d in dims)):
        raise TensorValueError(f"{op}: cannot reduce an empty dimension of a tensor of shape {list(x.shape)}")
    out = x._make(_kernel(op, x.device.type, x.dtype)(x.array, dims, keepdim), x.dtype, x.device)
    return _record(op, x, out, {"dims": dims, "keepdim": keepdim})


def amax(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return _extreme("amax", x, dim, keepdim)


def amin(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return _extreme("amin", x, dim, keepdim)


def _extreme_dim(op: str, x: Tensor, dim: int | None, keepdim: bool) -> Tensor | ValuesIndices:
    if dim is None:
        return _extreme("amax" if op == "max_dim" else "amin", x, None, False)
    dims = normalize_dims(dim, x.ndim, op[:3])
    axis = dims[0] if dims else 0
    if x.ndim and x.shape[axis] == 0:
        raise TensorValueError(f"{op[:3]}: cannot reduce the empty dim {dim} of shape {list(x.shape)}")
    values, indices = _kernel(op, x.device.type, x.dtype)(x.array, axis if x.ndim else None, keepdim)
    v = x._make(values, x.dtype, x.device)
    i = x._make(indices, int64, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder(op, (x,), (v, i), {"dim": axis, "keepdim": keepdim, "shape": x.shape})
    return ValuesIndices(v, i)


def max(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Any:
    """``max(x)`` → the largest element; ``max(x, dim)`` → (values, indices)."""
    if isinstance(dim, TensorBase):
        from blutrain.tensor.ops.elementwise import binary

        return binary("maximum", x, dim)
    return _extreme_dim("max_dim", x, dim, keepdim)


def min(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Any:
    if isinstance(dim, TensorBase):
        from blutrain.tensor.ops.elementwise import binary

        return binary("minimum", x, dim)
    return _extreme_dim("min_dim", x, dim, keepdim)


def _arg(op: str, x: Tensor, dim: int | None, keepdim: bool) -> Tensor:
    axis = None
    if dim is not None:
        dims = normalize_dims(dim, x.ndim, op)
        axis = dims[0] if dims else None
    if (x.numel() == 0 and axis is None) or (axis is not None and x.shape[axis] == 0):
        raise TensorValueError(f"{op}: cannot reduce an empty {'tensor' if axis is None else f'dim {dim}'} of "
                               f"shape {list(x.shape)}")
    return x._make(_kernel(op, x.device.type, x.dtype)(x.array, axis, keepdim), int64, x.device)


def argmax(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    return _arg("argmax", x, dim, keepdim)


def argmin(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    return _arg("argmin", x, dim, keepdim)


def _correction(correction: int, unbiased: bool | None) -> int:
    if unbiased is not None:
        return 1 if unbiased else 0
    return correction


def var(x: Tensor, dim: int | Sequence[int] | None = None, *, correction: int = 1, keepdim: bool = False,
        unbiased: bool | None = None) -> Tensor:
    _float_input(x, "var")
    dims = normalize_dims(dim, x.ndim, "var")
    c = _correction(correction, unbiased)
    out = x._make(_kernel("var", x.device.type, x.dtype)(x.array, dims, c, keepdim), x.dtype, x.device)
    return _record("var", x, out, {"dims": dims, "correction": c, "keepdim": keepdim})


def std(x: Tensor, dim: int | Sequence[int] | None = None, *, correction: int = 1, keepdim: bool = False,
        unbiased: bool | None = None) -> Tensor:
    from blutrain.tensor.ops.elementwise import unary

    return unary("sqrt", var(x, dim, correction=correction, keepdim=keepdim, unbiased=unbiased))


def norm(x: Tensor, p: float = 2.0, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The vector p-norm over ``dim`` (all elements by default); p may be inf."""
    _float_input(x, "norm")
    if not isinstance(p, (int, float)) or p <= 0:
        raise TensorValueError(f"norm: p must be a positive number or inf, got {p!r}")
    dims = normalize_dims(dim, x.ndim, "norm")
    out = x._make(_kernel("norm", x.device.type, x.dtype)(x.array, float(p), dims, keepdim), x.dtype, x.device)
    return _record("norm", x, out, {"p": float(p), "dims": dims, "keepdim": keepdim})


def logsumexp(x: Tensor, dim: int | Sequence[int], keepdim: bool = False) -> Tensor:
    _float_input(x, "logsumexp")
    dims = normalize_dims(dim, x.ndim, "logsumexp")
    out = x._make(_kernel("logsumexp", x.device.type, x.dtype)(x.array, dims, keepdim), x.dtype, x.device)
    return _record("logsumexp", x, out, {"dims": dims, "keepdim": keepdim})


def _softmax_like(op: str, x: Tensor, dim: int, dtype: DType | str | None) -> Tensor:
    if dtype is not None:
        x = x.to(dtype=dtype)
    elif autocast_state.dtype is not None:
        x = widen(x)
    _float_input(x, op)
    dims = normalize_dims(dim, x.ndim, op)
    axis = dims[0] if dims else -1
    out = x._make(_kernel(op, x.device.type, x.dtype)(x.array, axis), x.dtype, x.device)
    return _record(op, x, out, {"dim": axis})


def softmax(x: Tensor, dim: int, dtype: DType | str | None = None) -> Tensor:
    return _softmax_like("softmax", x, dim, dtype)


def log_softmax(x: Tensor, dim: int, dtype: DType | str | None = None) -> Tensor:
    return _softmax_like("log_softmax", x, dim, dtype)


def all(x: Tensor) -> Tensor:
    return x._make(_kernel("all", x.device.type, bool_)(x.array.astype(bool)), bool_, x.device)


def any(x: Tensor) -> Tensor:
    return x._make(_kernel("any", x.device.type, bool_)(x.array.astype(bool)), bool_, x.device)
