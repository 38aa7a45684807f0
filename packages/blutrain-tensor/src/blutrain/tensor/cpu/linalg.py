"""Generic GEMM kernels. ``linear`` folds batch dims into rows so that one GEMM does the work."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from blutrain.tensor.backend import array_module
from blutrain.tensor.dtype import HALF_NAMES

Array = Any


def matmul(a: Array, b: Array) -> Array:
    xp = array_module(a)
    out = xp.matmul(a, b)
    return out if isinstance(out, xp.ndarray) else xp.asarray(out)


def _rows(a: Array) -> Array:
    """``a`` as a matrix (all leading dims folded into rows); explicit sizes, so 0-size dims work."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def linear(x: Array, w: Array, b: Array | None) -> Array:
    out = _rows(x) @ w.T
    if b is not None:
        out += b
    return out.reshape((*x.shape[:-1], w.shape[0]))


def linear_gelu(x: Array, w: Array, b: Array | None, approximate: str) -> tuple[Array, Array]:
    """(gelu(pre), pre) with pre = x Wᵀ + b: the activation and the pre-activation its backward reads."""
    from blutrain.tensor.cpu.elementwise import gelu

    pre = linear(x, w, b)
    return gelu(pre, approximate), pre


def linear_add(residual: Array, x: Array, w: Array, b: Array | None) -> Array:
    """``residual + (x Wᵀ + b)`` in ``residual``'s dtype. Half operands are multiplied in float32 and the
    product is not rounded before the bias and the residual are added (one rounding, into the result);
    float32 and float64 add in eager order (product, bias, residual), so the result is eager's bit for bit."""
    half = x.dtype.name in HALF_NAMES
    if half:
        x, w = x.astype(np.float32), w.astype(np.float32)
    out = _rows(x) @ w.T
    if b is not None:
        out += b
    out += _rows(residual)
    return out.astype(residual.dtype, copy=False).reshape(residual.shape)


def linear_backward(grad: Array, x: Array, w: Array, need_x: bool, need_w: bool, need_b: bool,
                    wide_x: bool = False, wide_w: bool = False) -> tuple[Array | None, Array | None, Array | None]:
    """(dx, dW, db) of ``y = x Wᵀ + b``: dx = dy W, dW = dyᵀ x, db = Σ dy.

    Half-precision operands are multiplied in float32; the results are rounded to their dtype, except
    dx with ``wide_x`` and dW, db with ``wide_w``, which stay float32 (autocast's float32 operands).
    """
    half = x.dtype.name in HALF_NAMES
    dtype = x.dtype
    if half:
        grad, x, w = grad.astype(np.float32), x.astype(np.float32), w.astype(np.float32)
    g = _rows(grad)
    gx = (g @ w).reshape(x.shape) if need_x else None
    gw = g.T @ _rows(x) if need_w else None
    gb = g.sum(axis=0, dtype=g.dtype) if need_b else None
    if half:
        gx = gx if gx is None or wide_x else gx.astype(dtype)
        gw = gw if gw is None or wide_w else gw.astype(dtype)
        gb = gb if gb is None or wide_w else gb.astype(dtype)
    return gx, gw, gb
