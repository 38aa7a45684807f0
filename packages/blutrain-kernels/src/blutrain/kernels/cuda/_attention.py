"""Launchers of the flash-attention families: ``attention.cu`` (float32, 3xTF32), ``attention_bf16.cu``
(bfloat16 mma.sync) and, on compute capability 9.0, ``attention_wgmma.cu`` and ``attention_wgmma_bwd.cu``
(bfloat16, head dim 64, Hopper's wgmma); separate q, k, v or a packed [B, T, 3C] projection."""

from __future__ import annotations

from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _cp,
    _launch,
    _numel,
    _suffix,
    hopper_module,
)

# The kernels address every tensor through (batch, head, row) strides in elements (attention.cu's RowLayout), so
# a (B..., H, L, D) view whose D elements are contiguous reaches them as it is: the transposed q, k, v of a
# [B, T, 3C] projection, or the output written straight into a [B, T, C] buffer. Rows move by cp.async in
# 16-byte chunks, so the base pointer and every stride must be multiples of 16 bytes; a view that is not gets a
# contiguous (aligned) copy. lse, Delta and lse * log2(e) are [B*H, L] float32, contiguous.
# Grouped-query attention: k and v (and dk, dv) may have H / group heads, query head h reading key/value head
# h // group; every kernel takes `group` (1: one key/value head per query head). The forward and dq kernels
# run one block per (query tile, batch, query head); the dk/dv kernel one per (key tile, batch, key/value
# head), stepping through the group's query heads and summing dk, dv in registers: no expanded copy of k or
# v, no atomics, and group 1 computes exactly what it did before grouping existed.

_ATT_TILE = 64


# float32 tiles as attention.cu instantiates them, per head dim: (forward keys, dq keys, dk/dv queries) per
# step; each kernel's own side is _ATT_TILE rows (4 warps x 16).
_ATT_F32_TILES = {64: (64, 32, 32), 128: (32, 32, 32)}


def _aligned16(a: Array) -> Array:
    """``a`` itself, or a copy when its data is not 16-byte aligned (cp.async moves 16-byte chunks)."""
    return a if a.data.ptr % 16 == 0 else a.copy()


def _row_layout(a: Array) -> tuple[int, int, int] | None:
    """(batch, head, row) strides in elements of a (B..., H, L, D) view for the attention kernels, or None
    when the kernels cannot read it in place: D not contiguous, leading dims that do not collapse into one
    batch stride, or a base pointer or stride that is not a multiple of 16 bytes. A dim of size 1 is never
    stepped over, so its stride counts as 0."""
    item = a.itemsize
    shape, strides = a.shape, a.strides
    if shape[-1] > 1 and strides[-1] != item:
        return None
    st = [0 if n == 1 else s for n, s in zip(shape, strides, strict=True)]
    row = st[-2]
    head = st[-3] if a.ndim >= 3 else 0
    batch: int | None = None
    for n, s in zip(shape[:-3], st[:-3], strict=True):  # B... flattened in C order: one dim steps n of the next
        if n == 1:
            continue
        if batch is not None and batch != s * n:
            return None
        batch = s
    batch = batch or 0
    if a.data.ptr % 16 or row % 16 or head % 16 or batch % 16:
        return None
    return batch // item, head // item, row // item


def _attn_operand(a: Array) -> tuple[Array, tuple[int, int, int]]:
    """``a`` and its row layout, or an aligned contiguous copy of ``a`` and that copy's layout."""
    lay = _row_layout(a)
    if lay is None:
        a = _aligned16(_cp().ascontiguousarray(a))
        lay = _row_layout(a)
        assert lay is not None, "a contiguous array with D % (16 / itemsize) == 0 has an aligned layout"
    return a, lay


def _layout_args(*layouts: tuple[int, int, int]) -> tuple[Any, ...]:
    return tuple(np.int64(s) for lay in layouts for s in lay)


AttnShapes = tuple[str, int, int, int, int, int, int]


def _attn_shapes(q: Array, k: Array, v: Array, mask: Array | None) -> AttnShapes | None:
    """(kernel suffix, B*H, H, group, L, S, D) of a call the kernels cover, else None. ``group`` is H / H_kv
    when k and v have H_kv heads (dim -3, a divisor of q's H): grouped-query attention."""
    suffix = _suffix(q.dtype)
    if suffix is None or mask is not None or q.ndim < 2 or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    D = int(q.shape[-1])
    if D not in (64, 128) or k.shape[-1] != D or v.shape[-1] != D or k.shape[-2] != v.shape[-2]:
        return None
    if k.ndim != q.ndim or v.shape[:-2] != k.shape[:-2] or k.shape[:-3] != q.shape[:-3]:
        return None
    H = int(q.shape[-3]) if q.ndim >= 3 else 1
    H_kv = int(k.shape[-3]) if k.ndim >= 3 else 1
    if H_kv == 0 or H % H_kv:
        return None
    L, S = int(q.shape[-2]), int(k.shape[-2])
    BH = _numel(q.shape[:-2])
    if L == 0 or S == 0 or BH == 0 or BH > 65535:
        return None
    return suffix, BH, H, H // H_kv, L, S, D


def _attn_forward(q: Array, k: Array, v: Array, out: Array, suffix: str, BH: int, H: int, group: int, L: int,
                  S: int, D: int, causal: bool, scale: float) -> Array:
    """Launch the forward kernel on (B..., H, L, D) views, writing ``out`` (a view of the same shape, allocated
    aligned by the caller); returns the float32 lse [B*H, L]."""
    cp = _cp()
    (q, lq), (k, lk), (v, lv) = (_attn_operand(t) for t in (q, k, v))
    lo = _row_layout(out)
    assert lo is not None, "attention outputs are allocated 16-byte aligned"
    lse = cp.empty((BH, L), np.float32)
    args = (np.int32(L), np.int32(S), np.float32(scale), np.int32(bool(causal)), np.int32(H), np.int32(group),
            *_layout_args(lq, lk, lv, lo))
    if suffix == "bf16" and D == 64 and hopper_module("attention_wgmma") is not None:
        # Hopper's warpgroup MMA (attention_wgmma.cu): 2 warpgroups of 64 queries, 64-key tiles, S_j overlapping
        # P_{j-1} v_{j-1}; the same contract as the mma.sync kernel, and faster (docs/kernels.md)
        rows = 128
        smem = rows * 128 + 3 * 2 * 64 * 128 + 1024  # q, three stages of k and v, 1024-byte alignment slack
        _launch("attention_wgmma", "attn_wgmma_fwd_d64_wg2n64p", ((L + rows - 1) // rows, BH), (256,),
                (q, k, v, out, lse, *args), smem)
    elif suffix == "bf16":
        name, warps, rows = _ATT_BF16_FWD[D, bool(causal)]
        smem = (rows + 4 * _ATT_BF16_KEYS) * D * 2  # the query tile and two stages of key and value tiles
        _launch("attention_bf16", f"attn_bf16_fwd_d{D}_{name}", ((L + rows - 1) // rows, BH), (32 * warps,),
                (q, k, v, out, lse, *args), smem)
    else:  # 3xTF32 tensor cores; rows padded to D + 4 floats in shared memory
        smem = (_ATT_TILE + 2 * _ATT_F32_TILES[D][0]) * (D + 4) * 4
        _launch("attention", f"attn_fwd_f32_d{D}", ((L + _ATT_TILE - 1) // _ATT_TILE, BH), (128,),
                (q, k, v, out, lse, *args), smem)
    return lse


def _attn_backward(grad: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, dq: Array, dk: Array,
                   dv: Array, suffix: str, BH: int, H: int, group: int, L: int, S: int, D: int, causal: bool,
                   scale: float) -> None:
    """Launch the two backward kernels (dq per query tile first: it also writes Delta = rowsum(dO * out), and
    for bf16 lse * log2(e), per row; then dk/dv per key tile of each key/value head, B*H / group of them; no
    atomics: deterministic), writing the views ``dq``, ``dk``, ``dv`` (allocated aligned by the caller)."""
    cp = _cp()
    (q, lq), (k, lk), (v, lv), (grad, ldo), (out, lo) = (_attn_operand(t) for t in (q, k, v, grad, out))
    lsec = _aligned16(cp.ascontiguousarray(lse, dtype=np.float32).reshape(BH, L))
    ldq, ldk, ldv = (_row_layout(t) for t in (dq, dk, dv))
    assert ldq is not None and ldk is not None and ldv is not None, "attention gradients are allocated aligned"
    delta = cp.empty((BH, L), np.float32)
    head = (np.int32(L), np.int32(S), np.float32(scale), np.int32(bool(causal)), np.int32(H), np.int32(group))
    BH_kv = BH // group  # the dk/dv kernels' blocks: one per (key tile, batch, key/value head)
    if suffix == "bf16" and D == 64 and hopper_module("attention_wgmma_bwd") is not None:
        # Hopper's warpgroup MMA (attention_wgmma_bwd.cu), one warpgroup of 64 rows per block in both kernels; dq, dk,
        # dv within 2e-5 of attention_bf16.cu's, and faster (docs/kernels.md)
        lse2 = cp.empty((BH, L), np.float32)
        _launch("attention_wgmma_bwd", "attn_wgmma_bwd_dq_d64_wg1", ((L + 63) // 64, BH), (128,),
                (q, k, v, out, grad, lsec, lse2, delta, dq, *head, *_layout_args(lq, lk, lv, lo, ldo, ldq)),
                2 * 64 * 128 + 4 * 64 * 128 + 8 * 64 + 1024)  # q and dO, two stages of k and v, row stats, slack
        _launch("attention_wgmma_bwd", "attn_wgmma_bwd_dkv_d64_wg1", ((S + 63) // 64, BH_kv), (128,),
                (q, k, v, grad, lse2, delta, dk, dv, *head, *_layout_args(lq, lk, lv, ldo, ldk, ldv)),
                2 * 64 * 128 + 4 * 64 * 128 + 1024 + 1024)  # k and v, two stages of q and dO, their row stats
        return
    if suffix == "bf16":
        lse2 = cp.empty((BH, L), np.float32)
        name, warps, rows = _ATT_BF16_DQ[D]
        _launch("attention_bf16", f"attn_bf16_bwd_dq_d{D}_{name}", ((L + rows - 1) // rows, BH), (32 * warps,),
                (q, k, v, out, grad, lsec, lse2, delta, dq, *head, *_layout_args(lq, lk, lv, lo, ldo, ldq)),
                (3 * rows + 4 * _ATT_BF16_KEYS) * D * 2)
        name, warps, keys, queries = _ATT_BF16_DKV[D]
        _launch("attention_bf16", f"attn_bf16_bwd_dkv_d{D}_{name}", ((S + keys - 1) // keys, BH_kv),
                (32 * warps,),
                (q, k, v, grad, lse2, delta, dk, dv, *head, *_layout_args(lq, lk, lv, ldo, ldk, ldv)),
                (2 * keys + 4 * queries) * D * 2 + 4 * queries * 4)
        return
    t = _ATT_TILE  # 3xTF32 tensor cores
    _, bn, bq = _ATT_F32_TILES[D]
    _launch("attention", f"attn_bwd_dq_f32_d{D}", ((L + t - 1) // t, BH), (128,),
            (q, k, v, grad, out, lsec, delta, dq, *head, *_layout_args(lq, lk, lv, ldo, lo, ldq)),
            (2 * t + 2 * bn) * (D + 4) * 4)
    _launch("attention", f"attn_bwd_dkv_f32_d{D}", ((S + t - 1) // t, BH_kv), (128,),
            (q, k, v, grad, lsec, delta, dk, dv, *head, *_layout_args(lq, lk, lv, ldo, ldk, ldv)),
            ((2 * t + 2 * bq) * (D + 4) + 2 * bq) * 4)


def sdpa(q: Array, k: Array, v: Array, mask: Array | None, causal: bool, scale: float) -> tuple[Array, Array] | None:
    """Flash-attention forward: (out, float32 lse) without the L x S matrix; None when a mask is given. q, k, v
    are read in place when their D elements are contiguous (transposed views included); k and v may have
    fewer heads than q (grouped-query attention)."""
    shapes = _attn_shapes(q, k, v, mask)
    if shapes is None:
        return None
    suffix, BH, H, group, L, S, D = shapes
    out = _cp().empty(q.shape, q.dtype)
    lse = _attn_forward(q, k, v, out, suffix, BH, H, group, L, S, D, causal, scale)
    return out, lse.reshape(q.shape[:-1])


def sdpa_backward(grad: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, mask: Array | None,
                  causal: bool, scale: float) -> tuple[Array, Array, Array] | None:
    """Flash-attention backward (dq, dk, dv), recomputing P from the saved lse; deterministic. With grouped
    key/value heads dk and dv (k's and v's shapes) sum over each head's query group."""
    shapes = _attn_shapes(q, k, v, mask)
    if shapes is None or grad.shape != q.shape or out.shape != q.shape:
        return None
    suffix, BH, H, group, L, S, D = shapes
    cp = _cp()
    dq, dk, dv = cp.empty(q.shape, q.dtype), cp.empty(k.shape, q.dtype), cp.empty(v.shape, q.dtype)
    _attn_backward(grad, q, k, v, out, lse, dq, dk, dv, suffix, BH, H, group, L, S, D, causal, scale)
    return dq, dk, dv


def _packed_heads(qkv: Array, n_head: int) -> tuple[Array, Array, Array]:
    """q, k, v of a [B, T, 3C] projection as (B, H, T, D) views. A contiguous array (the gradient buffer, whose
    views the kernels write) is always viewed; a strided one is sliced, a view too wherever its strides allow."""
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    if qkv.flags.c_contiguous:
        parts = qkv.reshape(B, T, 3, n_head, D)
        return tuple(parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    C = C3 // 3
    return tuple(qkv[:, :, i * C:(i + 1) * C].reshape(B, T, n_head, D).transpose(0, 2, 1, 3)
                 for i in range(3))


def _merged_heads(y: Array, n_head: int) -> Array:
    """A [B, T, C] array as the (B, H, T, D) view the kernels write."""
    B, T, C = y.shape
    return y.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _packed_shapes(qkv: Array, n_head: int) -> AttnShapes | None:
    if qkv.ndim != 3 or n_head <= 0 or qkv.shape[-1] % (3 * n_head):
        return None
    q, k, v = _packed_heads(qkv, n_head)
    return _attn_shapes(q, k, v, None)


def sdpa_packed(qkv: Array, n_head: int, causal: bool, scale: float) -> tuple[Array, Array] | None:
    """Multi-head self-attention over a packed [B, T, 3C] projection (q | k | v, head h at columns h*D of
    each): y [B, T, C] written by the kernel in place of the (B, H, T, D) output, float32 lse [B, H, T]."""
    shapes = _packed_shapes(qkv, n_head)
    if shapes is None:
        return None
    suffix, BH, H, group, L, S, D = shapes
    B, T, C3 = qkv.shape
    y = _cp().empty((B, T, C3 // 3), qkv.dtype)
    q, k, v = _packed_heads(qkv, n_head)
    lse = _attn_forward(q, k, v, _merged_heads(y, n_head), suffix, BH, H, group, L, S, D, causal, scale)
    return y, lse.reshape(B, H, T)


def sdpa_packed_backward(grad: Array, qkv: Array, out: Array, lse: Array, n_head: int, causal: bool,
                         scale: float) -> Array | None:
    """dqkv [B, T, 3C] in qkv's dtype, its three parts written by the kernels directly (no zero fill, no
    concatenation): dq by the dq kernel, dk and dv by the dk/dv kernel."""
    shapes = _packed_shapes(qkv, n_head)
    if shapes is None or grad.shape != out.shape or out.shape != (*qkv.shape[:2], qkv.shape[2] // 3):
        return None
    suffix, BH, H, group, L, S, D = shapes
    dqkv = _cp().empty(qkv.shape, qkv.dtype)
    q, k, v = _packed_heads(qkv, n_head)
    dq, dk, dv = _packed_heads(dqkv, n_head)
    _attn_backward(_merged_heads(grad, n_head), q, k, v, _merged_heads(out, n_head), lse, dq, dk, dv, suffix, BH,
                   H, group, L, S, D, causal, scale)
    return dqkv


# bfloat16 attention on the tensor cores (attention_bf16.cu). Tile shape (kernel name suffix, warps, rows per
# block), rows being queries (forward, dq) or keys (dk/dv), plus queries per step for dk/dv; the forward's is
# chosen per (head dim, causal): the fastest of the tile shapes timed on an H100 (docs/kernels.md). Forward and dq
# step over 64 keys at a time.
_ATT_BF16_FWD = {(64, False): ("w4m2", 4, 128), (64, True): ("w4m2", 4, 128),
                 (128, False): ("w4m2s", 4, 128), (128, True): ("w4m1", 4, 64)}
_ATT_BF16_DKV = {64: ("w4q64", 4, 64, 64), 128: ("w4q32", 4, 64, 32)}
_ATT_BF16_DQ = {64: ("w4b3", 4, 64), 128: ("w4", 4, 64)}
_ATT_BF16_KEYS = 64


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "sdpa": (sdpa, ("float32", "bfloat16")),
    "sdpa_backward": (sdpa_backward, ("float32", "bfloat16")),
    "sdpa_packed": (sdpa_packed, ("float32", "bfloat16")),
    "sdpa_packed_backward": (sdpa_packed_backward, ("float32", "bfloat16")),
}
