"""Generic GEMM kernels. ``linear`` folds batch dims into rows so that one GEMM does the work."""

from __future__ import annotations

import math
from typing import Any

from blutrain.tensor.backend import array_module

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


def linear_backward(grad: Array, x: Array, w: Array, need_x: bool, need_w: bool,
                    need_b: bool) -> tuple[Array | None, Array | None, Array | None]:
    """(dx, dW, db) of ``y = x Wᵀ + b``: dx = dy W, dW = dyᵀ x, db = Σ dy."""
    g = _rows(grad)
    gx = (g @ w).reshape(x.shape) if need_x else None
    gw = g.T @ _rows(x) if need_w else None
    gb = g.sum(axis=0, dtype=g.dtype) if need_b else None
    return gx, gw, gb
