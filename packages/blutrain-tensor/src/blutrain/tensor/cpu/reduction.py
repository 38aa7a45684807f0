"""Generic reduction and softmax kernels (``axes`` is None for all dims, or a sorted tuple)."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from blutrain.tensor.backend import array_module

Array = Any
_quiet = functools.partial(np.errstate, all="ignore")


def _arr(xp: Any, v: Any) -> Array:
    return v if isinstance(v, xp.ndarray) else xp.asarray(v)


def sum(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.sum(a, axis=axes, keepdims=keepdim, dtype=a.dtype))


def _count(a: Array, axes: tuple[int, ...] | None) -> int:
    return int(a.size) if axes is None else math.prod(a.shape[i] for i in axes)


def mean(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array:
    # sum / count rather than xp.mean: an empty reduction is 0/0 = NaN quietly, not a warning
    xp = array_module(a)
    with _quiet():
        return _arr(xp, xp.sum(a, axis=axes, keepdims=keepdim, dtype=a.dtype) / _count(a, axes))


def amax(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.max(a, axis=axes, keepdims=keepdim))


def amin(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.min(a, axis=axes, keepdims=keepdim))


def max_dim(a: Array, axis: int | None, keepdim: bool) -> tuple[Array, Array]:
    xp = array_module(a)
    idx = xp.argmax(a, axis=axis, keepdims=keepdim)
    return _arr(xp, xp.max(a, axis=axis, keepdims=keepdim)), _arr(xp, idx).astype(np.int64)


def min_dim(a: Array, axis: int | None, keepdim: bool) -> tuple[Array, Array]:
    xp = array_module(a)
    idx = xp.argmin(a, axis=axis, keepdims=keepdim)
    return _arr(xp, xp.min(a, axis=axis, keepdims=keepdim)), _arr(xp, idx).astype(np.int64)


def argmax(a: Array, axis: int | None, keepdim: bool) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.argmax(a, axis=axis, keepdims=keepdim)).astype(np.int64)


def argmin(a: Array, axis: int | None, keepdim: bool) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.argmin(a, axis=axis, keepdims=keepdim)).astype(np.int64)


def var(a: Array, axes: tuple[int, ...] | None, correction: int, keepdim: bool) -> Array:
    """Two passes (mean, then squared deviations), as xp.var, divided by max(count − correction, 0):
    inf or NaN when nothing is left, without xp.var's warning."""
    xp = array_module(a)
    n = _count(a, axes)
    with _quiet():
        xc = a - xp.sum(a, axis=axes, keepdims=True, dtype=a.dtype) / n
        out = xp.sum(xc * xc, axis=axes, keepdims=keepdim, dtype=a.dtype) / max(n - correction, 0)
    return _arr(xp, out)


def norm(a: Array, p: float, axes: tuple[int, ...] | None, keepdim: bool) -> Array:
    xp = array_module(a)
    mag = xp.abs(a)
    if p == float("inf"):
        # the max of no magnitudes is 0; a sum over the same axes gives that with the right shape
        out = xp.max(mag, axis=axes, keepdims=keepdim) if a.size else xp.sum(mag, axis=axes, keepdims=keepdim)
    elif p == 2.0:
        out = xp.sqrt(xp.sum(mag * mag, axis=axes, keepdims=keepdim, dtype=a.dtype))
    elif p == 1.0:
        out = xp.sum(mag, axis=axes, keepdims=keepdim, dtype=a.dtype)
    else:
        out = xp.sum(mag**p, axis=axes, keepdims=keepdim, dtype=a.dtype) ** (1.0 / p)
    return _arr(xp, out).astype(a.dtype, copy=False)


def logsumexp(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array:
    xp = array_module(a)
    with _quiet():
        m = xp.max(a, axis=axes, keepdims=True) if a.size else xp.zeros((1,) * a.ndim, a.dtype)
        m = xp.where(xp.isfinite(m), m, 0)  # all -inf rows stay -inf instead of becoming NaN
        s = xp.sum(xp.exp(a - m), axis=axes, keepdims=True, dtype=a.dtype)
        out = xp.log(s) + m
    if not keepdim:
        out = out.reshape(tuple(d for i, d in enumerate(a.shape) if axes is not None and i not in axes))
    return _arr(xp, out)


def softmax(a: Array, axis: int) -> Array:
    xp = array_module(a)
    if a.ndim == 0:
        return softmax(a.reshape(1), 0).reshape(())
    if a.size == 0:
        return a.copy()
    with _quiet():
        e = xp.exp(a - xp.max(a, axis=axis, keepdims=True))
        return e / xp.sum(e, axis=axis, keepdims=True)


def log_softmax(a: Array, axis: int) -> Array:
    if a.ndim == 0:
        return log_softmax(a.reshape(1), 0).reshape(())
    return a - logsumexp(a, (axis % a.ndim,), True)


def softmax_backward(grad: Array, out: Array, axis: int) -> Array:
    """dx = y ∘ (dy − Σ dy∘y), the softmax Jacobian applied without forming it."""
    xp = array_module(out)
    if out.ndim == 0:
        return softmax_backward(grad.reshape(1), out.reshape(1), 0).reshape(())
    return out * (grad - xp.sum(grad * out, axis=axis, keepdims=True))


def log_softmax_backward(grad: Array, out: Array, axis: int) -> Array:
    """dx = dy − exp(y) Σ dy, from the saved output y = log_softmax(x)."""
    xp = array_module(out)
    if out.ndim == 0:
        return log_softmax_backward(grad.reshape(1), out.reshape(1), 0).reshape(())
    return grad - xp.exp(out) * xp.sum(grad, axis=axis, keepdims=True)


def all(a: Array) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.all(a))


def any(a: Array) -> Array:
    xp = array_module(a)
    return _arr(xp, xp.any(a))
