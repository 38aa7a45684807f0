"""GEMM on the "cuda" device through cuBLAS (CuPy's matmul calls cublasGemmEx).

float32 is strict by default (CUBLAS_COMPUTE_32F): TF32 rounds operands to 10 mantissa bits and
is used only when asked, through :func:`set_tf32` or CuPy's own ``CUPY_TF32=1``. bfloat16 and
float16 operands accumulate in float32 (CUBLAS_COMPUTE_32F on tensor cores); a CuPy that cannot
multiply bfloat16 gets float32 products rounded once instead.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from blutrain.kernels import cuda as fused

Array = Any
_tf32 = False
_bf16_native: bool | None = None  # learnt on the first bfloat16 product


def tf32_requested_by_env() -> bool:
    """CuPy's switch ``CUPY_TF32=1`` (off when unset)."""
    return int(os.environ.get("CUPY_TF32", "0") or "0") > 0


def set_tf32(enabled: bool) -> None:
    """Let float32 GEMMs round their operands to TF32 (about 3e-4 relative error, several times faster)."""
    global _tf32
    from cupy._core import _routines_linalg as linalg

    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if enabled else linalg.COMPUTE_TYPE_DEFAULT)
    _tf32 = bool(enabled)


def tf32_enabled() -> bool:
    return _tf32


def _matmul_bf16(a: Array, b: Array) -> Array:
    global _bf16_native
    import cupy as cp

    if a.ndim > 2 and b.ndim == 2:
        out = _matmul_bf16(_rows(a), b)  # a weight applied to batched rows: one matrix product
        return out.reshape((*a.shape[:-1], b.shape[1]))
    if a.ndim != 2 or b.ndim != 2:
        # CuPy sends every bfloat16 product but matrix × matrix (vectors, batches) down an integer
        # tensordot path that does not know the dtype (seen with CuPy 14.2): compute those in float32,
        # rounded once
        return cp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
    if _bf16_native is None:
        try:
            out = cp.matmul(a, b)
        except Exception:  # once per process: which exception a CuPy without bf16 GEMM raises varies
            _bf16_native = False
        else:
            _bf16_native = True
            return out
    if _bf16_native:
        return cp.matmul(a, b)
    return cp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def matmul(a: Array, b: Array) -> Array:
    import cupy as cp

    if a.dtype.name == "bfloat16":
        return _matmul_bf16(a, b)
    if a.dtype.name == "float16" and (a.ndim < 2 or b.ndim < 2):
        # CuPy's float16 vector products (dot) accumulate in float16: ~7 ulps off over 13 terms, seen on an
        # H100 with CuPy 14.2. In float32, rounded once, as the matrix products are.
        return cp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
    return cp.matmul(a, b)


def _rows(a: Array) -> Array:
    """``a`` as a matrix, leading dims folded into rows (explicit sizes: 0-size dims work)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def linear(x: Array, w: Array, b: Array | None) -> Array:
    """``x Wᵀ + b`` with batch dims folded into rows: one GEMM (Wᵀ is a transposed view, no copy)."""
    out = matmul(_rows(x), w.T)
    if b is not None:
        out += b
    return out.reshape((*x.shape[:-1], w.shape[0]))


def linear_backward(grad: Array, x: Array, w: Array, need_x: bool, need_w: bool,
                    need_b: bool) -> tuple[Array | None, Array | None, Array | None]:
    """(dx, dW, db) of ``y = x Wᵀ + b``: dx = dy W, dW = dyᵀ x (two GEMMs), db = Σ dy (fused column sum)."""
    g = _rows(grad)
    gx = matmul(g, w).reshape(x.shape) if need_x else None
    gw = matmul(g.T, _rows(x)) if need_w else None
    gb = None
    if need_b:
        gb = fused.sum_cols(g)
        if gb is None and g.dtype.name == "float16":
            gb = g.sum(axis=0, dtype=np.float32).astype(g.dtype)  # accumulate in float32, round once
        elif gb is None:
            gb = g.sum(axis=0, dtype=g.dtype)
    return gx, gw, gb
