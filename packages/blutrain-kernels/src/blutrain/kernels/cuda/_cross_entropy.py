"""Launchers of ``cross_entropy.cu``: softmax cross-entropy over [N, C] logits, forward (optionally with the
gradient in the same kernel) and backward."""

from __future__ import annotations

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _contig,
    _cp,
    _launch,
    _ptr,
    _row_threads,
    _suffix,
    _variant,
    shared_memory_per_sm,
)

_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _ce_checks(logits: Array, target: Array, reduction: str) -> tuple[str, int, int] | None:
    suffix = _suffix(logits.dtype)
    if suffix is None or logits.ndim != 2 or reduction not in _REDUCTIONS:
        return None
    N, C = int(logits.shape[0]), int(logits.shape[1])
    if N == 0 or C == 0 or C >= 2**31 or target.shape != (N,):
        return None
    return suffix, N, C


def _ce_rows(logits: Array, target: Array, ignore_index: int, label_smoothing: float, with_grad: bool,
             count: Array | None) -> tuple[str, Array, Array, Array, Array | None] | None:
    """(suffix, contiguous target, float32 loss per row, lse, dlogits) in one kernel; dlogits is scaled by
    1/count when ``count`` (a device int64) is given, else by 1 on every row that is not ignored."""
    checked = _ce_checks(logits, target, "none")
    if checked is None:
        return None
    suffix, N, C = checked
    cp = _cp()
    lc = _contig(logits)
    tc = cp.ascontiguousarray(target, dtype=np.int64)
    loss_rows = cp.empty((N,), np.float32)
    lse = cp.empty((N,), np.float32)
    dlogits = cp.empty((N, C), logits.dtype) if with_grad else None
    name, vec = _variant(suffix, C, lc, dlogits)
    args = (lc, tc, np.int32(C), np.int64(ignore_index), np.float32(label_smoothing), loss_rows, lse, _ptr(dlogits),
            _ptr(count))
    staged = _staged_vectors(C // vec) if with_grad and vec > 1 else 0
    if staged:  # the row read once: staged in shared memory for the gradient
        _launch("cross_entropy", f"ce_fused_{name}", (N,), (_row_threads(C // vec),), (*args, np.int32(staged)),
                smem=16 * staged)
    else:
        _launch("cross_entropy", f"ce_fwd_{name}", (N,), (_row_threads(C // vec),), args)
    return suffix, tc, loss_rows, lse, dlogits


def _staged_vectors(nvec: int) -> int:
    """16-byte vectors of a row that ce_fused_* holds in shared memory: all ``nvec`` if they fit, else as many
    as leave room for two blocks per multiprocessor (each with its static table and the 1 KB the hardware
    reserves per block), so that one block's reads overlap the other's arithmetic and writes."""
    budget = shared_memory_per_sm() // 2 - 2048
    return max(0, min(nvec, budget // 16))


def _ce_forward(logits: Array, target: Array, ignore_index: int, label_smoothing: float, reduction: str,
                with_grad: bool) -> tuple[Array, Array, Array | None] | None:
    if _ce_checks(logits, target, reduction) is None:
        return None
    cp = _cp()
    count = None
    if with_grad and reduction == "mean":
        count = cp.count_nonzero(cp.asarray(target) != ignore_index).astype(np.int64)
    rows = _ce_rows(logits, target, ignore_index, label_smoothing, with_grad, count)
    assert rows is not None
    suffix, tc, loss_rows, lse, dlogits = rows
    if reduction == "none":
        loss = loss_rows if suffix == "f32" else loss_rows.astype(logits.dtype)
    else:
        loss = cp.empty((), logits.dtype)
        _launch("cross_entropy", f"ce_reduce_{suffix}", (1,), (1024,),
                (loss_rows, tc, np.int64(tc.shape[0]), np.int64(ignore_index), np.int32(reduction == "mean"),
                 loss))
    return loss, lse, dlogits


def cross_entropy_rows(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                       with_grad: bool) -> tuple[Array, Array | None] | None:
    """(float32 loss per row, dlogits for an upstream gradient of 1 per row) over [N, C] logits, one
    kernel; ignored rows have loss 0 and a zero gradient. Not an op of its own: the building block of
    fused losses that process the rows in chunks (``linear_cross_entropy``)."""
    rows = _ce_rows(logits, target, ignore_index, label_smoothing, with_grad, None)
    return None if rows is None else (rows[2], rows[4])


def cross_entropy(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                  reduction: str) -> tuple[Array, Array] | None:
    """(loss, lse) of softmax cross-entropy over [N, C] logits; one pass per row."""
    res = _ce_forward(logits, target, ignore_index, label_smoothing, reduction, with_grad=False)
    return None if res is None else (res[0], res[1])


def cross_entropy_with_grad(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                            reduction: str) -> tuple[Array, Array, Array] | None:
    """(loss, lse, dlogits) in one kernel: the gradient of the reduced loss for an upstream gradient of
    1 ('none' takes 1 per row), written while the row is still in L2. Not an op of its own: for fused
    training steps (the compiler) that know the loss is the last op."""
    res = _ce_forward(logits, target, ignore_index, label_smoothing, reduction, with_grad=True)
    if res is None:
        return None
    loss, lse, dlogits = res
    assert dlogits is not None
    return loss, lse, dlogits


def cross_entropy_backward(grad: Array, logits: Array, target: Array, lse: Array, ignore_index: int,
                           label_smoothing: float, reduction: str) -> Array | None:
    checked = _ce_checks(logits, target, reduction)
    if checked is None:
        return None
    suffix, N, C = checked
    cp = _cp()
    lc = _contig(logits)
    tc = cp.ascontiguousarray(target, dtype=np.int64)
    gc = cp.ascontiguousarray(grad, dtype=logits.dtype).reshape(-1)
    lsec = cp.ascontiguousarray(lse, dtype=np.float32)
    count = cp.count_nonzero(tc != ignore_index).astype(np.int64) if reduction == "mean" else None
    dlogits = cp.empty((N, C), logits.dtype)
    name, vec = _variant(suffix, C, lc, dlogits)
    _launch("cross_entropy", f"ce_bwd_{name}", (N,), (_row_threads(C // vec),),
            (gc, lc, tc, lsec, dlogits, np.int32(C), np.int64(ignore_index), np.float32(label_smoothing),
             np.int32(_REDUCTIONS[reduction]), _ptr(count)))
    return dlogits


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "cross_entropy": (cross_entropy, ("float32", "bfloat16")),
    "cross_entropy_backward": (cross_entropy_backward, ("float32", "bfloat16")),
}
