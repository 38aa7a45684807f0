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


# ---------------------------------------------------------------------------------------------- cublasGemmEx

_CUDA_DTYPE = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType: CUDA_R_32F, _16F, _16BF
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77  # cublasComputeType_t
_OP_N, _OP_T = 0, 1
_ALGO_DEFAULT = -1
# alpha and beta: cuBLAS reads them on the host during the call (the handle's default pointer mode)
_ONE = np.ones((), np.float32)
_ZERO = np.zeros((), np.float32)


def gemm_into(a: Array, b: Array, out: Array, *, trans_a: bool = False, trans_b: bool = False,
              accumulate: bool = False) -> None:
    """``out = op(a) @ op(b)`` (``+= `` with ``accumulate``) for C-contiguous row-major matrices, in one
    cublasGemmEx that accumulates in float32 whatever the dtypes: bfloat16 operands can write a float32
    result, and a sum of products over chunks stays in float32 without a temporary.

    cuBLAS is column-major: a row-major (r, c) matrix is its (c, r) transpose there, so the row-major
    ``out`` (m, n) is computed as the column-major ``outᵀ = op(b)ᵀ op(a)ᵀ``.
    """
    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    kb, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    if kb != k or out.shape != (m, n):
        raise ValueError(f"gemm_into: op(a) {m}x{k} times op(b) {kb}x{n} does not fit out {tuple(out.shape)}")
    for name, arr in (("a", a), ("b", b), ("out", out)):
        if arr.ndim != 2 or not arr.flags.c_contiguous or arr.dtype.name not in _CUDA_DTYPE:
            raise ValueError(f"gemm_into: {name} must be a C-contiguous float32/float16/bfloat16 matrix, got "
                             f"{arr.dtype.name} {tuple(arr.shape)} with strides {arr.strides}")
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            out.fill(0)
        return
    strict = not (_tf32 and a.dtype.name == "float32" and b.dtype.name == "float32")
    cublas.gemmEx(cp.cuda.device.get_cublas_handle(), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N,
                  n, m, k, _ONE.ctypes.data, b.data.ptr, _CUDA_DTYPE[b.dtype.name], b.shape[1],
                  a.data.ptr, _CUDA_DTYPE[a.dtype.name], a.shape[1], (_ONE if accumulate else _ZERO).ctypes.data,
                  out.data.ptr, _CUDA_DTYPE[out.dtype.name], n,
                  _COMPUTE_32F if strict else _COMPUTE_32F_FAST_TF32, _ALGO_DEFAULT)


def linear_cross_entropy(x: Array, w: Array, target: Array, ignore_index: int, label_smoothing: float, mean: bool,
                         compute: str, loss_dtype: str, need_x: bool, need_w: bool,
                         chunk_rows: int) -> tuple[Array, Array, Array | None, Array | None]:
    """The LM head and its loss chunk by chunk (see ``blutrain.tensor.linear_cross_entropy``): per chunk one
    GEMM writes the logits in the compute dtype, one kernel their loss rows and gradient, then two
    GEMMs the input gradient (written in x's dtype) and the weight gradient (accumulated in float32
    across chunks by cuBLAS's beta = 1). float32 or bfloat16 compute; anything else runs the generic
    kernel on CuPy."""
    import cupy as cp

    from blutrain.tensor.cpu import nn as generic

    if (compute not in ("float32", "bfloat16") or x.dtype.name not in ("float32", "bfloat16")
            or w.dtype != x.dtype or x.ndim != 2 or w.shape[0] >= 2**31):
        return generic.linear_cross_entropy(x, w, target, ignore_index, label_smoothing, mean, compute, loss_dtype,
                                            need_x, need_w, chunk_rows)
    cd = x.dtype if x.dtype.name == compute else w.astype(compute_np(compute)).dtype
    xs = cp.ascontiguousarray(x.astype(cd, copy=False))
    ws = cp.ascontiguousarray(w.astype(cd, copy=False))
    tc = cp.ascontiguousarray(target, dtype=np.int64)
    n, c = xs.shape
    v = ws.shape[0]
    need = need_x or need_w
    loss_rows = cp.empty((n,), np.float32)
    dx = cp.empty((n, c), x.dtype) if need_x else None
    dw32 = (cp.empty if n else cp.zeros)((v, c), np.float32) if need_w else None
    for i, start in enumerate(range(0, n, chunk_rows)):
        stop = min(n, start + chunk_rows)
        logits = cp.empty((stop - start, v), cd)
        gemm_into(xs[start:stop], ws, logits, trans_b=True)
        rows = fused.cross_entropy_rows(logits, tc[start:stop], ignore_index, label_smoothing, need)
        if rows is None:
            raise AssertionError(f"cross_entropy_rows refused [{stop - start}, {v}] {cd} logits")
        loss_rows[start:stop] = rows[0]
        del logits  # the chunk's logits go back to the pool before its gradient GEMMs
        dl = rows[1]
        if dl is not None:
            if dx is not None:
                gemm_into(dl, ws, dx[start:stop])
            if dw32 is not None:
                gemm_into(dl, xs[start:stop], dw32, trans_a=True, accumulate=i > 0)
    count = cp.count_nonzero(tc != ignore_index)
    total = loss_rows.sum()
    loss = (total / count if mean else total).astype(compute_np(loss_dtype))
    scale = (1.0 / count if mean else cp.ones((), np.float64)).astype(np.float32)
    dw = None if dw32 is None else dw32 if w.dtype.name == "float32" else dw32.astype(w.dtype)
    return loss, scale, dx, dw


def compute_np(name: str) -> Any:
    """The NumPy dtype of a BluTrain dtype name (bfloat16 through ml_dtypes)."""
    from blutrain.tensor.dtype import as_dtype

    return as_dtype(name).np
