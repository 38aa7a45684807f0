"""Launchers of ``layernorm.cu``: LayerNorm forward (with the compiler's ``layernorm-cast`` output dtype and
``layernorm-residual`` operand) and backward (with the ``layernorm-grad-outputs`` extras)."""

from __future__ import annotations

from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _contig,
    _cp,
    _launch,
    _numel,
    _ptr,
    _resident_blocks,
    _row_threads,
    _suffix,
    _variant,
    sm_count,
)
from blutrain.tensor.dtype import bfloat16


def layer_norm(x: Array, w: Array | None, b: Array | None, eps: float, k: int, out_dtype: Any = None,
               residual: Array | None = None) -> tuple[Array, ...] | None:
    """(y, mean, rstd) of LayerNorm over the trailing ``k`` dims; mean and rstd in float32. ``out_dtype``: y in
    that dtype (float32 x to bfloat16 y here: the compiler's ``layernorm-cast`` pass), rounded once.
    ``residual``: see :func:`layer_norm_residual`."""
    if residual is not None:
        return layer_norm_residual(x, residual, w, b, eps, k, out_dtype)
    suffix = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    if suffix is None or N == 0 or C == 0 or C >= 2**31:
        return None
    to = x.dtype if out_dtype is None else np.dtype(out_dtype)
    if to != x.dtype and (suffix != "f32" or _suffix(to) != "bf16"):
        return None
    cp = _cp()
    xc = _contig(x)
    wc, bc = _contig(w), _contig(b)
    y = cp.empty(x.shape, to)
    lead = x.shape[: x.ndim - k]
    mean = cp.empty(lead, np.float32)
    rstd = cp.empty(lead, np.float32)
    name, vec = _variant(suffix, C, xc, wc, bc, y)
    if to != x.dtype:
        name = name.replace("f32", "f32_to_bf16", 1)
    _launch("layernorm", f"layernorm_fwd_{name}", (N,), (_row_threads(C // vec),),
            (xc, _ptr(wc), _ptr(bc), y, mean, rstd, np.int32(C), np.float32(eps)))
    return y, mean, rstd


def layer_norm_residual(x: Array, r: Array, w: Array | None, b: Array | None, eps: float, k: int,
                        out_dtype: Any = None) -> tuple[Array, Array, Array, Array] | None:
    """(y, mean, rstd, s) of LayerNorm of s = r + x (the compiler's ``layernorm-residual`` pass): x bfloat16 or
    float32 (a projection), r float32 of x's shape (the residual stream), float32 w, b; s float32, y float32 or
    bfloat16. Each s is one float32 add, and the launch (VEC 4, the float32 kernel's threads) makes mean, rstd
    and y the bits of a float32 add of the two followed by :func:`layer_norm` of the sum."""
    sx = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    to = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
    if (sx is None or r.dtype != np.float32 or tuple(r.shape) != tuple(x.shape) or _suffix(to) is None
            or any(p is not None and p.dtype != np.float32 for p in (w, b)) or N == 0 or C == 0 or C >= 2**31):
        return None
    cp = _cp()
    # fresh copies where a view starts unaligned: the unfused LayerNorm reads a fresh sum, and the vector width
    # (so the order of each row's sums) must be the one it takes
    xc, rc = (a if a.flags.c_contiguous and a.data.ptr % 16 == 0 else a.copy() for a in (x, r))
    wc, bc = _contig(w), _contig(b)
    s = cp.empty(x.shape, np.float32)
    y = cp.empty(x.shape, to)
    lead = x.shape[: x.ndim - k]
    mean = cp.empty(lead, np.float32)
    rstd = cp.empty(lead, np.float32)
    _, vec = _variant("f32", C, wc, bc)
    _launch("layernorm", f"layernorm_fwd_res_{sx}_{_suffix(to)}_v{vec}", (N,), (_row_threads(C // vec),),
            (xc, rc, _ptr(wc), _ptr(bc), s, y, mean, rstd, np.int32(C), np.float32(eps)))
    return y, mean, rstd, s


_LN_BWD_THREADS = 256  # the kernels' __launch_bounds__: a row group (TG threads) is at most one block
_LN_BWD_NPER = {1: (1, 2, 4, 8, 16), 4: (1, 2, 3, 4), 8: (1, 2)}  # compiled vectors-per-thread variants


def _ln_bwd_shape(nv: int, vec: int) -> tuple[int, int] | None:
    """(row-group threads TG, vectors per thread NPER) of layernorm_bwd_*_n*, or None if the row is too
    wide to sit in one block's registers (C > 4096): TG the smallest power of two >= 32 with
    TG * max NPER >= nv."""
    allowed = _LN_BWD_NPER[vec]
    tg = 32
    while tg * allowed[-1] < nv:
        tg *= 2
        if tg > _LN_BWD_THREADS:
            return None
    need = (nv + tg - 1) // tg
    return tg, next(k for k in allowed if k >= need)


def layer_norm_backward(grad: Array, x: Array, w: Array | None, mean: Array, rstd: Array, k: int, need_w: bool,
                        need_b: bool, addend: Array | None = None, dx_copy_dtype: Any = None,
                        need_dx_sum: bool = False) -> tuple[Array | None, ...] | None:
    """(dx, dweight, dbias); dweight/dbias are None unless asked for. ``addend`` (x's dtype, broadcastable to
    x): dx + addend, added to each float32 dx before it is stored (one rounding, as a separate float32 add).

    With ``dx_copy_dtype`` or ``need_dx_sum`` (float32 x; the copy bfloat16): (dx, dweight, dbias, dx in
    bfloat16, dx's column sums over its leading dims), the readers of dx that the compiler's
    ``layernorm-grad-outputs`` pass folds in. The copy is the cast kernel's bits of the stored dx; the sums
    are float32 accumulations of the stored dx in this kernel's fixed order, not ``sum_cols``'s. These come from
    kernels of their own (``*_out``), which may hold fewer blocks per SM than the plain ones (not at GPT-2's
    widths): dweight/dbias then add their blocks' partials in another grouping than the plain call's."""
    suffix = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    if suffix is None or N == 0 or C == 0 or C >= 2**31:
        return None
    if addend is not None and addend.dtype != x.dtype:
        return None
    extra = dx_copy_dtype is not None or need_dx_sum
    if extra and (suffix != "f32" or (dx_copy_dtype is not None and _suffix(dx_copy_dtype) != "bf16")):
        return None
    accumulate = need_w or need_b or need_dx_sum
    tables = 3 if need_dx_sum else 2
    cp = _cp()
    gc, xc, wc = _contig(grad), _contig(x), _contig(w)
    ac = None if addend is None else cp.ascontiguousarray(cp.broadcast_to(addend, x.shape))
    mc, rc = (cp.ascontiguousarray(s, dtype=np.float32) for s in (mean, rstd))
    dx = cp.empty(x.shape, x.dtype)
    dxc = None if dx_copy_dtype is None else cp.empty(x.shape, bfloat16.np)
    name, vec = _variant(suffix, C, gc, xc, wc, dx, ac, dxc)
    out = "_out" if extra else ""
    shape = _ln_bwd_shape(C // vec, vec)
    if shape is not None:
        tg, nper = shape
        rg = max(1, _LN_BWD_THREADS // tg)
        kname = f"layernorm_bwd_{name}_n{nper}{out}"
        # bf16: the dweight/dbias sums in shared memory, a slot per (row group, vector, element, thread)
        sums = rg * nper * 2 * vec * tg if suffix == "bf16" else (3 if extra else 2) * C
        smem = (128 * rg + (sums if accumulate else 0)) * 4
        if smem > 227 * 1024:
            return None
        G = min((N + rg - 1) // rg, _resident_blocks("layernorm", kname, tg * rg, smem))
        block: tuple[int, ...] = (tg, rg)
    else:
        smem = (72 + (3 if extra else 2) * C) * 4 if accumulate else 72 * 4
        if smem > 227 * 1024:
            return None
        kname = f"layernorm_bwd_{name}{out}"
        G = min(N, 4 * sm_count())
        block = (_row_threads(C // vec, hi=1024),)
    partial = cp.empty((tables, G, C), np.float32) if accumulate else None
    flags = (1 if need_w or need_b else 0) | (2 if need_dx_sum else 0)
    _launch("layernorm", kname, (G,), block,
            (gc, xc, _ptr(wc), mc, rc, _ptr(ac), dx, _ptr(dxc), _ptr(partial), np.int32(N), np.int32(C),
             np.int32(flags)), smem)
    ns = x.shape[x.ndim - k:]
    dw = cp.empty(ns, x.dtype) if need_w else None
    db = cp.empty(ns, x.dtype) if need_b else None
    ds = cp.empty(ns, x.dtype) if need_dx_sum else None
    if accumulate:
        _launch("layernorm", f"layernorm_bwd_reduce_{suffix}", ((tables * C + 31) // 32,), (32, 16),
                (partial, _ptr(dw), _ptr(db), _ptr(ds), np.int32(G), np.int32(C), np.int32(tables)))
    return (dx, dw, db, dxc, ds) if extra else (dx, dw, db)


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "layer_norm": (layer_norm, ("float32", "bfloat16")),
    "layer_norm_backward": (layer_norm_backward, ("float32", "bfloat16")),
}
