"""Launchers of ``gelu.cu``: GELU (erf and tanh forms) forward and backward, and bias + GELU over column tiles,
its backward writing the bias gradient's column sums in the same launch."""

from __future__ import annotations

import numpy as np

from blutrain.kernels.cuda._core import (
    _NULL,
    Array,
    Registry,
    _contig,
    _cp,
    _elementwise_grid,
    _launch,
    _ptr,
    _suffix,
    _variant,
    _vec,
)
from blutrain.kernels.cuda._reduce import _COL_BLOCK, _COL_LANES, _column_plan, _column_scratch


def gelu(a: Array, approximate: str = "none") -> Array | None:
    suffix = _suffix(a.dtype)
    if suffix is None or a.size == 0 or approximate not in ("none", "tanh"):
        return None
    cp = _cp()
    ac = _contig(a)
    y = cp.empty(a.shape, a.dtype)
    name, vec = _variant(suffix, _vec(suffix), ac, y)
    _launch("gelu", f"gelu_fwd_{name}", _elementwise_grid((a.size // vec + 1) // 2), (256,),
            (ac, y, np.int64(a.size), np.int32(approximate == "tanh")))
    return y


def gelu_backward(grad: Array, a: Array, approximate: str = "none") -> Array | None:
    suffix = _suffix(a.dtype)
    if suffix is None or a.size == 0 or approximate not in ("none", "tanh") or grad.shape != a.shape:
        return None
    cp = _cp()
    gc, ac = _contig(grad), _contig(a)
    dx = cp.empty(a.shape, a.dtype)
    name, vec = _variant(suffix, _vec(suffix), gc, ac, dx)
    _launch("gelu", f"gelu_bwd_{name}", _elementwise_grid((a.size // vec + 1) // 2), (256,),
            (gc, ac, dx, np.int64(a.size), np.int32(approximate == "tanh")))
    return dx


def _bias_gelu_shape(x: Array, bias: Array, approximate: str) -> tuple[str, int, int] | None:
    suffix = _suffix(x.dtype)
    if suffix is None or x.size == 0 or x.ndim == 0 or approximate not in ("none", "tanh"):
        return None
    D = int(x.shape[-1])
    if bias.dtype != x.dtype or bias.shape != (D,) or D >= 2**31:
        return None
    return suffix, x.size // D, D


def bias_gelu(x: Array, bias: Array, approximate: str = "tanh") -> Array | None:
    """GELU(x + bias) with ``bias`` (D,) over the last dim of ``x``, one pass."""
    found = _bias_gelu_shape(x, bias, approximate)
    if found is None:
        return None
    suffix, N, D = found
    cp = _cp()
    xc, bc = _contig(x), _contig(bias)
    y = cp.empty(x.shape, x.dtype)
    name, vec = _variant(suffix, D, xc, bc, y)
    tiles, chunks, rows_per = _column_plan(cp.cuda.runtime.getDevice(), N, D // vec, vec, 4 * _COL_LANES)
    _launch("gelu", f"bias_gelu_fwd_{name}", (tiles, chunks), _COL_BLOCK,
            (xc, bc, y, np.int64(N), np.int32(D), np.int64(rows_per), np.int32(approximate == "tanh")))
    return y


def bias_gelu_backward(grad: Array, x: Array, bias: Array, approximate: str = "tanh",
                       need_bias: bool = True) -> tuple[Array, Array | None] | None:
    """(dx, dbias): dx = grad * GELU'(x + bias), dbias its column sums (None unless asked for), one launch."""
    found = _bias_gelu_shape(x, bias, approximate)
    if found is None or grad.shape != x.shape or grad.dtype != x.dtype:
        return None
    suffix, N, D = found
    cp = _cp()
    gc, xc, bc = _contig(grad), _contig(x), _contig(bias)
    dx = cp.empty(x.shape, x.dtype)
    db = cp.empty((D,), x.dtype) if need_bias else None
    name, vec = _variant(suffix, D, gc, xc, bc, dx)
    dev = cp.cuda.runtime.getDevice()
    tiles, chunks, rows_per = _column_plan(dev, N, D // vec, vec, 2 * _COL_LANES)
    partial, counters = _column_scratch(dev) if need_bias and chunks > 1 else (_NULL, _NULL)
    _launch("gelu", f"bias_gelu_bwd_{name}", (tiles, chunks), _COL_BLOCK,
            (gc, xc, bc, dx, _ptr(db), partial, counters, np.int64(N), np.int32(D), np.int64(rows_per),
             np.int32(approximate == "tanh"), np.int32(bool(need_bias))))
    return dx, db


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "gelu": (gelu, ("float32", "bfloat16")),
    "gelu_backward": (gelu_backward, ("float32", "bfloat16")),
    "bias_gelu": (bias_gelu, ("float32", "bfloat16")),
    "bias_gelu_backward": (bias_gelu_backward, ("float32", "bfloat16")),
}
