"""Launchers of ``softmax.cu``: softmax and log-softmax over the last dim, forward and backward."""

from __future__ import annotations

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _contig,
    _cp,
    _launch,
    _row_threads,
    _suffix,
    _variant,
)


def _last_axis(a: Array, axis: int) -> bool:
    return bool(a.ndim >= 1 and axis % a.ndim == a.ndim - 1)


def _softmax(a: Array, axis: int, log_flag: int) -> Array | None:
    suffix = _suffix(a.dtype)
    if suffix is None or a.size == 0 or not _last_axis(a, axis) or a.shape[-1] >= 2**31:
        return None
    cp = _cp()
    C = int(a.shape[-1])
    ac = _contig(a)
    y = cp.empty(a.shape, a.dtype)
    name, vec = _variant(suffix, C, ac, y)
    _launch("softmax", f"softmax_fwd_{name}", (a.size // C,), (_row_threads(C // vec),),
            (ac, y, np.int32(C), np.int32(log_flag)))
    return y


def _softmax_bwd(grad: Array, out: Array, axis: int, log_flag: int) -> Array | None:
    suffix = _suffix(out.dtype)
    if suffix is None or out.size == 0 or not _last_axis(out, axis) or grad.shape != out.shape:
        return None
    cp = _cp()
    C = int(out.shape[-1])
    gc, oc = _contig(grad), _contig(out)
    dx = cp.empty(out.shape, out.dtype)
    name, vec = _variant(suffix, C, gc, oc, dx)
    _launch("softmax", f"softmax_bwd_{name}", (out.size // C,), (_row_threads(C // vec),),
            (gc, oc, dx, np.int32(C), np.int32(log_flag)))
    return dx


def softmax(a: Array, axis: int) -> Array | None:
    return _softmax(a, axis, 0)


def log_softmax(a: Array, axis: int) -> Array | None:
    return _softmax(a, axis, 1)


def softmax_backward(grad: Array, out: Array, axis: int) -> Array | None:
    return _softmax_bwd(grad, out, axis, 0)


def log_softmax_backward(grad: Array, out: Array, axis: int) -> Array | None:
    return _softmax_bwd(grad, out, axis, 1)


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "softmax": (softmax, ("float32", "bfloat16")),
    "log_softmax": (log_softmax, ("float32", "bfloat16")),
    "softmax_backward": (softmax_backward, ("float32", "bfloat16")),
    "log_softmax_backward": (log_softmax_backward, ("float32", "bfloat16")),
}
