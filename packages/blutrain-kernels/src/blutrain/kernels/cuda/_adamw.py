"""Launcher of ``adamw.cu``: one AdamW step over a list of tensors in one launch (two with the global-norm
clip), through a tensor table and a tile table cached per set of buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _aligned,
    _cp,
    _launch,
    _ptr,
    _resident_blocks,
    _suffix,
)
from blutrain.kernels.cuda._plans import _cached_plan, _upload
from blutrain.tensor.errors import ShapeError, TensorTypeError

ADAMW_TILE = 2048  # elements per tile of the tile table (adamw.cu's ADAMW_TILE)
_ADAMW_THREADS = 256
_ADAMW_GRAD_BF16 = 1
_ADAMW_ALIGNED = 2
# Launch plans (device tensor table, device tile table, tile count), keyed by device, weight decays and
# the buffers' pointers, sizes and grad dtypes: an optimizer passes the same buffers every step, so a
# step after the first builds and copies nothing. A hit requires every array contiguous; shapes are
# checked on the call that built the plan (an update is elementwise, so equal sizes suffice after).
_adamw_plans: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}
# Plans that a captured CUDA graph reads at every replay: never evicted, and their tables are device
# memory of their own (not of the capturing graph's pool, which may go away before a later hit).
_adamw_graph_plans: dict[tuple[Any, ...], tuple[Any, Any, int]] = {}



def _adamw_plan(params: Sequence[Array], grads: Sequence[Array], exp_avgs: Sequence[Array],
                exp_avg_sqs: Sequence[Array], wds: list[float],
                capturing: bool) -> tuple[Any, Any, int, list[Array]]:
    """Validate the four lists and build the device tables; returns them and the grads actually used
    (contiguous copies of non-contiguous grads, which the caller must keep alive until the launch)."""
    cp = _cp()
    n = len(params)
    table = np.zeros((n, 8), np.int64)
    keep: list[Array] = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        for name, arr in (("param", p), ("exp_avg", m), ("exp_avg_sq", v)):
            if arr.dtype != np.float32 or not arr.flags.c_contiguous:
                raise TensorTypeError(f"adamw_multi_tensor: {name} {i} must be a contiguous float32 array, got "
                                      f"dtype {arr.dtype}, contiguous={arr.flags.c_contiguous}")
            if arr.shape != p.shape:
                raise ShapeError(f"adamw_multi_tensor: {name} {i} has shape {arr.shape}, param {p.shape}")
        if g.shape != p.shape:
            raise ShapeError(f"adamw_multi_tensor: grad {i} has shape {g.shape}, param {p.shape}")
        gsuf = _suffix(g.dtype)
        if gsuf is None:
            raise TensorTypeError(f"adamw_multi_tensor: grad {i} must be float32 or bfloat16, got {g.dtype}")
        if capturing and not g.flags.c_contiguous:
            # the table would point at a copy that the graph's pool hands to later nodes
            raise TensorTypeError(f"adamw_multi_tensor: grad {i} is not contiguous; while a CUDA graph is "
                                  "captured every grad must be contiguous")
        g = cp.ascontiguousarray(g)
        keep.append(g)
        flags = (_ADAMW_GRAD_BF16 if gsuf == "bf16" else 0) | (_ADAMW_ALIGNED if _aligned(p, g, m, v) else 0)
        table[i] = (p.data.ptr, g.data.ptr, m.data.ptr, v.data.ptr, p.size, flags, 0, 0)
    table[:, 6] = np.asarray(wds, np.float32).view(np.int32).astype(np.int64)
    counts = (table[:, 4] + ADAMW_TILE - 1) // ADAMW_TILE
    K = int(counts.sum())
    tiles = np.empty((K, 2), np.int32)
    tiles[:, 0] = np.repeat(np.arange(n, dtype=np.int32), counts)
    tiles[:, 1] = np.arange(K, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    if K == 0:
        return None, None, 0, keep
    return _upload(table, capturing), _upload(tiles, capturing), K, keep


def _adamw_grad_scale(grad_scale: Array | None, grads: Sequence[Array], max_grad_norm: float | None) -> bool:
    """Check ``grad_scale`` (None, or a 0-d CuPy array of every gradient's dtype) before any launch; whether it
    is bfloat16 (the kernel reads it as such)."""
    if grad_scale is None:
        return False
    cp = _cp()
    if max_grad_norm is not None:
        raise TensorTypeError("adamw_multi_tensor: grad_scale and max_grad_norm both given; pass one (the clip's "
                              f"coefficient, or the norm to clip to), got max_grad_norm={max_grad_norm!r}")
    if type(grad_scale) is not cp.ndarray or grad_scale.shape != () or _suffix(grad_scale.dtype) is None:
        raise TensorTypeError(f"adamw_multi_tensor: grad_scale must be a 0-d float32 or bfloat16 CuPy array, got "
                              f"{type(grad_scale).__name__} {getattr(grad_scale, 'dtype', '')} "
                              f"{getattr(grad_scale, 'shape', '')}")
    for i, g in enumerate(grads):
        if g.dtype != grad_scale.dtype:
            # the in-place scale it stands for takes one dtype: grads and coefficient alike
            raise TensorTypeError(f"adamw_multi_tensor: grad {i} has dtype {g.dtype}, grad_scale {grad_scale.dtype}; "
                                  "grad_scale must have every gradient's dtype")
    return _suffix(grad_scale.dtype) == "bf16"


def adamw_multi_tensor(params: Sequence[Array], grads: Sequence[Array], exp_avgs: Sequence[Array],
                       exp_avg_sqs: Sequence[Array], step_scalars: Array, beta1: float, beta2: float, eps: float,
                       weight_decay: float | Sequence[float], grad_scale: Array | None = None,
                       max_grad_norm: float | None = None) -> Array | None:
    """One AdamW step over every tensor in one launch (two with clipping), updating params, exp_avgs
    and exp_avg_sqs in place.

    params, exp_avgs, exp_avg_sqs: contiguous float32 arrays; grads: float32 or bfloat16, same shapes
    (not modified). ``step_scalars``: float64 [3] on the device, (lr, 1 - beta1**t, sqrt(1 - beta2**t))
    for step t (from 1); the kernel reads it when it runs, so a captured CUDA graph replays with the
    values written into it since. ``weight_decay`` is one value or one per tensor.

    ``grad_scale``: a 0-d CuPy array of the gradients' dtype (every grad must have it), read when the kernel
    runs; each gradient element is multiplied by it as it is read and rounded to the gradient's dtype, so the
    step equals ``scale_multi_tensor(grads, grad_scale)`` followed by this kernel without it, bit for bit (the
    compiler's ``adamw-grad-scale`` pass hands it the global-norm clip's coefficient). The 10th positional
    argument, as on the CPU, where the compiled IR puts it.

    With ``max_grad_norm`` (not together with ``grad_scale``) the gradients are scaled by min(1, max_norm /
    (norm + 1e-6)), norm being the 2-norm over all gradients, and the norm (float32, 0-d, before clipping) is
    returned; else None.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ShapeError(f"adamw_multi_tensor: got {n} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
                         f"{len(exp_avg_sqs)} exp_avg_sqs; the four lists must have one entry per parameter")
    cp = _cp()
    if type(step_scalars) is not cp.ndarray or step_scalars.dtype != np.float64 or step_scalars.shape != (3,) \
            or not step_scalars.flags.c_contiguous:
        got = f"{step_scalars.dtype} {tuple(step_scalars.shape)}" if hasattr(step_scalars, "dtype") else \
            type(step_scalars).__name__
        raise TensorTypeError(f"adamw_multi_tensor: step_scalars must be a contiguous float64 CuPy array of shape (3,) "
                              f"(lr, 1 - beta1**t, sqrt(1 - beta2**t)), got {got}")
    gscale_bf16 = _adamw_grad_scale(grad_scale, grads, max_grad_norm)
    wds = [float(weight_decay)] * n if isinstance(weight_decay, (int, float)) else [float(w) for w in weight_decay]
    if len(wds) != n:
        raise ShapeError(f"adamw_multi_tensor: {len(wds)} weight decays for {n} params")
    arrays = (*params, *grads, *exp_avgs, *exp_avg_sqs)
    contiguous = all(a.flags.c_contiguous for a in arrays)
    key = (cp.cuda.Device().id, tuple(wds), tuple([a.data.ptr for a in arrays]), tuple([a.size for a in arrays]),
           tuple([a.dtype for a in arrays]))
    keep: list[Array] = []

    def build(capturing: bool) -> tuple[Any, Any, int]:
        dtable, dtiles, K, kept = _adamw_plan(params, grads, exp_avgs, exp_avg_sqs, wds, capturing)
        keep.extend(kept)
        return dtable, dtiles, K

    dtable, dtiles, K = _cached_plan(key, contiguous, build, _adamw_plans, _adamw_graph_plans)
    if K == 0:
        return cp.zeros((), np.float32) if max_grad_norm is not None else None
    norm = None
    partial = None
    npartial = 0
    if max_grad_norm is not None:
        npartial = min(K, _resident_blocks("adamw", "adamw_sqnorm", _ADAMW_THREADS))
        partial = cp.empty((npartial,), np.float32)
        norm = cp.empty((), np.float32)
        _launch("adamw", "adamw_sqnorm", (npartial,), (_ADAMW_THREADS,), (dtable, dtiles, np.int32(K), partial))
    grid = (min(K, _resident_blocks("adamw", "adamw_update", _ADAMW_THREADS)),)
    _launch("adamw", "adamw_update", grid, (_ADAMW_THREADS,),
            (dtable, dtiles, np.int32(K), _ptr(partial), np.int32(npartial), np.float32(max_grad_norm or 0.0),
             step_scalars, np.float32(beta1), np.float32(beta2), np.float32(eps), _ptr(norm), _ptr(grad_scale),
             np.int32(gscale_bf16)))
    keep.clear()  # the grad copies the tables point at, alive until the launch
    return norm


# ops with no generic kernel: this family's part of the package's STANDALONE
STANDALONE: Registry = {
    "adamw_multi_tensor": (adamw_multi_tensor, ("float32",)),
}
