"""Launchers of ``casts.cu``: float32 / bfloat16 / float16 conversions bit for bit as NumPy and ml_dtypes, one
array at a time or a list of arrays in one launch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _cp,
    _elementwise_grid,
    _launch,
)
from blutrain.kernels.cuda._plans import _cached_plan, _upload
from blutrain.tensor.dtype import bfloat16, float16, float32
from blutrain.tensor.errors import TensorTypeError

# (source, target) dtype -> casts.cu's (16-byte vector kernel, one-element kernel)
_CAST_SHORT = {float32: "f32", bfloat16: "bf16", float16: "f16"}
_CASTS: dict[tuple[np.dtype[Any], np.dtype[Any]], tuple[str, str]] = {
    (src.np, dst.np): (f"cast_{a}_{b}_v8", f"cast_{a}_{b}_v1")
    for src, a in _CAST_SHORT.items() for dst, b in _CAST_SHORT.items() if src is not dst}
_CAST_THREADS = (256,)


def cast(a: Array, dtype: Any) -> Array | None:
    """``a.astype(dtype)`` between float32, bfloat16 and float16, bit for bit as NumPy and ml_dtypes convert
    (round to nearest even; NaN rules in casts.cu), for an array contiguous in C or Fortran order (the result
    has the same order). None for other dtype pairs and for strided views, which CuPy's astype converts."""
    names = _CASTS.get((a.dtype, np.dtype(dtype)))
    if names is None:
        return None
    flags = a.flags
    if flags.c_contiguous:
        order = "C"
    elif flags.f_contiguous:
        order = "F"
    else:
        return None
    out = _cp().empty(a.shape, dtype, order=order)
    n = a.size
    if n == 0:
        return out
    if a.data.ptr % 16 == 0 and out.data.ptr % 16 == 0:
        _launch("casts", names[0], _elementwise_grid(n >> 3), _CAST_THREADS, (a, out, np.int64(n)))
    else:  # a view at an offset that is not a multiple of 16 bytes
        _launch("casts", names[1], _elementwise_grid((n + 3) >> 2), _CAST_THREADS, (a, out, np.int64(n)))
    return out


CAST_TILE = 4096  # elements per block of the multi-tensor casts (casts.cu's CAST_TILE)
_MULTI_CASTS = {pair: v8.replace("_v8", "_multi_tensor") for pair, (v8, _) in _CASTS.items()}
# Launch plans of cast_multi_tensor (device table, tensors, blocks), keyed by device, dtypes and the buffers'
# pointers and sizes; those a captured graph reads are kept for good (see _cached_plan).
_cast_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}
_cast_graph_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}


def _cast_plan(pairs: Sequence[tuple[Array, Array]]) -> tuple[Any, int, int]:
    """(device table, tensors, blocks) of casts.cu's multi-tensor kernels over non-empty contiguous (source,
    result) pairs: one row per tensor (source pointer, result pointer, numel, first block), CAST_TILE elements
    per block; cached by buffers."""
    cp = _cp()
    key = (cp.cuda.Device().id, tuple([s.data.ptr for s, _ in pairs]), tuple([d.data.ptr for _, d in pairs]),
           tuple([s.size for s, _ in pairs]), pairs[0][0].dtype, pairs[0][1].dtype)

    def build(capturing: bool) -> tuple[Any, int, int]:
        table = np.zeros((len(pairs), 4), np.int64)
        blocks = [(s.size + CAST_TILE - 1) // CAST_TILE for s, _ in pairs]
        table[:, 0] = [s.data.ptr for s, _ in pairs]
        table[:, 1] = [d.data.ptr for _, d in pairs]
        table[:, 2] = [s.size for s, _ in pairs]
        table[:, 3] = np.cumsum(blocks) - blocks
        return _upload(table, capturing), len(pairs), int(table[-1, 3]) + blocks[-1]

    plan: tuple[Any, int, int] = _cached_plan(key, True, build, _cast_plans, _cast_graph_plans)
    return plan


def cast_multi_tensor(arrays: Sequence[Array], dtype: Any) -> list[Array]:
    """``[a.astype(dtype) for a in arrays]`` (one source dtype for all), bit for bit as :func:`cast` converts
    each array: the C-contiguous arrays of a float32/bfloat16/float16 pair in one launch, whatever their
    number and sizes (under autocast a step's weights become bf16 together instead of one small launch
    each); another array (an F-ordered or strided view) or another pair goes through :func:`cast` or CuPy's
    astype, as the single cast would, so each result has the single cast's memory order too."""
    cp = _cp()
    if not arrays:
        return []
    src = arrays[0].dtype
    for i, a in enumerate(arrays):
        if type(a) is not cp.ndarray or a.dtype != src:
            raise TensorTypeError(f"cast_multi_tensor: array {i} must be a CuPy array of dtype {src} like array 0, "
                                  f"got {type(a).__name__} {getattr(a, 'dtype', '')}")
    dt = np.dtype(dtype)
    kernel = _MULTI_CASTS.get((src, dt))
    outs: list[Array] = []
    pairs: list[tuple[Array, Array]] = []
    for a in arrays:
        if kernel is not None and a.flags.c_contiguous and a.size:
            out = cp.empty(a.shape, dt)
            pairs.append((a, out))
        else:
            single = cast(a, dt)
            out = a.astype(dt) if single is None else single
        outs.append(out)
    if kernel is not None and pairs:
        table, n, K = _cast_plan(pairs)
        _launch("casts", kernel, (K,), _CAST_THREADS, (table, np.int32(n)))
    return outs


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "cast": (cast, ("float32", "bfloat16", "float16")),
}
# ops with no generic kernel: this family's part of the package's STANDALONE
STANDALONE: Registry = {
    "cast_multi_tensor": (cast_multi_tensor, ("float32", "bfloat16", "float16")),
}
