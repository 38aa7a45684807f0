"""Launchers of ``llama.cu``: RMSNorm forward (with its residual operand) and backward, rotary embeddings of q
and k, SwiGLU forward and backward, with the argument order of the generic kernels they replace
(``blutrain.tensor.cpu.nn``). Each returns ``None`` outside what its kernel covers (another dtype, an empty
tensor, rotary angles other than float32), so the device plugin runs the generic kernel instead."""

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
    _row_threads,
    _suffix,
    sm_count,
)

_THREADS = 256


def _grid(n: int) -> tuple[int]:
    return (max(1, min((n + _THREADS - 1) // _THREADS, 8 * sm_count())),)


def rms_norm(x: Array, w: Array | None, eps: float, k: int, out_dtype: Any = None,
             residual: Array | None = None) -> tuple[Array, ...] | None:
    """(y, rstd) of RMSNorm over the trailing ``k`` dims, rstd float32. ``out_dtype``: y in that dtype (float32
    x and w to a bf16 y: the compiler's ``layernorm-cast`` pass). ``residual`` (float32, x's shape; float32 or
    bf16 x, float32 w): the row normalized is residual + x and the result is (y, rstd, s), s the float32 sum
    (``layernorm-residual``). Other combinations are left to the generic kernel."""
    suffix = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    to = x.dtype if out_dtype is None else np.dtype(out_dtype)
    if suffix is None or _suffix(to) is None or N == 0 or C >= 2**31:
        return None
    cp = _cp()
    xc, wc = _contig(x), _contig(w)
    y = cp.empty(x.shape, to)
    rstd = cp.empty(x.shape[: x.ndim - k], np.float32)
    block = (_row_threads(C),)
    if residual is None:
        if wc is not None and wc.dtype != x.dtype:
            return None
        if to == x.dtype:
            name = f"rmsnorm_fwd_{suffix}"
        elif suffix == "f32":
            name = "rmsnorm_fwd_f32_to_bf16"
        else:
            return None
        _launch("llama", name, (N,), block, (xc, _ptr(wc), y, rstd, np.int32(C), np.float32(eps)))
        return y, rstd
    if residual.dtype != np.float32 or residual.shape != x.shape or (wc is not None and wc.dtype != np.float32):
        return None
    s = cp.empty(x.shape, np.float32)
    _launch("llama", f"rmsnorm_fwd_res_{suffix}_{_suffix(to)}", (N,), block,
            (xc, _contig(residual), _ptr(wc), y, s, rstd, np.int32(C), np.float32(eps)))
    return y, rstd, s


def rms_norm_backward(grad: Array, x: Array, w: Array | None, rstd: Array, k: int,
                      need_w: bool) -> tuple[Array, Array | None] | None:
    """(dx, dw): dw summed over the per-block partials in a fixed order (deterministic)."""
    suffix = _suffix(x.dtype)
    C = _numel(x.shape[x.ndim - k:])
    N = x.size // C if C else 0
    if suffix is None or N == 0 or grad.dtype != x.dtype or rstd.dtype != np.float32:
        return None
    cp = _cp()
    G = max(1, min(N, 2 * sm_count()))
    dx = cp.empty(x.shape, x.dtype)
    partial = cp.empty((G, C), np.float32)
    _launch("llama", f"rmsnorm_bwd_{suffix}", (G,), (_row_threads(C),),
            (_contig(grad), _contig(x), _ptr(_contig(w)), _contig(rstd), dx, partial, np.int64(N), np.int32(C),
             np.int32(bool(need_w))))
    dw = partial.sum(axis=0).astype(x.dtype).reshape(x.shape[x.ndim - k:]) if need_w else None
    return dx, dw


def _rope(q: Array, k: Array, cos: Array, sin: Array, inverse: bool) -> tuple[Array, Array] | None:
    suffix = _suffix(q.dtype)
    if suffix is None or k.dtype != q.dtype or cos.dtype != np.float32 or sin.dtype != np.float32 or q.size == 0:
        return None
    cp = _cp()
    _, T, H, D = q.shape
    Hk = k.shape[2]
    qo, ko = cp.empty(q.shape, q.dtype), cp.empty(k.shape, k.dtype)
    q_pairs, k_pairs = q.size // 2, k.size // 2
    _launch("llama", f"rope_{suffix}", _grid(q_pairs + k_pairs), (_THREADS,),
            (_contig(q), _contig(k), qo, ko, _contig(cos), _contig(sin), np.int64(q_pairs), np.int64(k_pairs),
             np.int32(T), np.int32(H), np.int32(Hk), np.int32(D), np.int32(inverse)))
    return qo, ko


def rope(q: Array, k: Array, cos: Array, sin: Array) -> tuple[Array, Array] | None:
    """Rotary embeddings of q (B, T, H, D) and k (B, T, Hk, D), one launch; float32 angles only."""
    return _rope(q, k, cos, sin, False)


def rope_backward(grad_q: Array, grad_k: Array, cos: Array, sin: Array) -> tuple[Array, Array] | None:
    """The gradients of q and k rotated back (the opposite angle), one launch."""
    return _rope(grad_q, grad_k, cos, sin, True)


def swiglu(gate: Array, up: Array) -> Array | None:
    suffix = _suffix(gate.dtype)
    if suffix is None or up.dtype != gate.dtype or gate.size == 0:
        return None
    cp = _cp()
    y = cp.empty(gate.shape, gate.dtype)
    _launch("llama", f"swiglu_fwd_{suffix}", _grid(gate.size), (_THREADS,),
            (_contig(gate), _contig(up), y, np.int64(gate.size)))
    return y


def swiglu_backward(grad: Array, gate: Array, up: Array, need_gate: bool,
                    need_up: bool) -> tuple[Array | None, Array | None] | None:
    suffix = _suffix(gate.dtype)
    if suffix is None or up.dtype != gate.dtype or grad.dtype != gate.dtype or gate.size == 0:
        return None
    cp = _cp()
    dgate = cp.empty(gate.shape, gate.dtype) if need_gate else None
    dup = cp.empty(gate.shape, gate.dtype) if need_up else None
    _launch("llama", f"swiglu_bwd_{suffix}", _grid(gate.size), (_THREADS,),
            (_contig(grad), _contig(gate), _contig(up), _ptr(dgate), _ptr(dup), np.int64(gate.size)))
    return dgate, dup


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "rms_norm": (rms_norm, ("float32", "bfloat16")),
    "rms_norm_backward": (rms_norm_backward, ("float32", "bfloat16")),
    "rope": (rope, ("float32", "bfloat16")),
    "rope_backward": (rope_backward, ("float32", "bfloat16")),
    "swiglu": (swiglu, ("float32", "bfloat16")),
    "swiglu_backward": (swiglu_backward, ("float32", "bfloat16")),
}

__all__ = ["KERNELS", "rms_norm", "rms_norm_backward", "rope", "rope_backward", "swiglu", "swiglu_backward"]
