"""Launchers of ``scale.cu``: the global-norm clip over a list of tensors, the norm in two launches and the
in-place rescale by a 0-d device coefficient in one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    Registry,
    _cp,
    _launch,
    _suffix,
)
from blutrain.kernels.cuda._plans import _cached_plan, _upload
from blutrain.tensor.errors import TensorTypeError

SCALE_TILE = 4096  # elements per block (scale.cu's SCALE_TILE)
_scale_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}
_scale_graph_plans: dict[tuple[Any, ...], tuple[Any, int, int]] = {}


def _tile_plan(dense: Sequence[Array]) -> tuple[Any, int, int]:
    """(device table, tensors, blocks) of scale.cu's kernels over contiguous, non-empty ``dense``: one row per
    tensor (pointer, numel, first block), SCALE_TILE elements per block; cached by buffers."""
    cp = _cp()
    key = (cp.cuda.Device().id, tuple([a.data.ptr for a in dense]), tuple([a.size for a in dense]), dense[0].dtype)

    def build(capturing: bool) -> tuple[Any, int, int]:
        table = np.zeros((len(dense), 3), np.int64)
        blocks = [(a.size + SCALE_TILE - 1) // SCALE_TILE for a in dense]
        table[:, 0] = [a.data.ptr for a in dense]
        table[:, 1] = [a.size for a in dense]
        table[:, 2] = np.cumsum(blocks) - blocks
        return _upload(table, capturing), len(dense), int(table[-1, 2]) + blocks[-1]

    plan: tuple[Any, int, int] = _cached_plan(key, True, build, _scale_plans, _scale_graph_plans)
    return plan


def _same_dtype(name: str, arrays: Sequence[Array]) -> str:
    """The kernel suffix of ``arrays``' one dtype (float32 or bfloat16); a clear error otherwise."""
    cp = _cp()
    dt = arrays[0].dtype
    suffix = _suffix(dt)
    if suffix is None:
        raise TensorTypeError(f"{name}: arrays must be float32 or bfloat16, got {dt}")
    for i, a in enumerate(arrays):
        if type(a) is not cp.ndarray or a.dtype != dt:
            raise TensorTypeError(f"{name}: array {i} must be a CuPy array of dtype {dt} like array 0, "
                                  f"got {type(a).__name__} {getattr(a, 'dtype', '')}")
    return suffix


def norm_multi_tensor(arrays: Sequence[Array]) -> Array:
    """The 2-norm of all elements of ``arrays`` together (all float32 or all bfloat16), a float32 0-d array:
    the global-norm clip's norm in two launches (per-tile sums of squares, then one block adding them in a
    fixed order), reading each element once. Strided views are read from contiguous copies."""
    cp = _cp()
    if not arrays:
        return cp.zeros((), np.float32)
    suffix = _same_dtype("norm_multi_tensor", arrays)
    dense = [cp.ascontiguousarray(a) for a in arrays if a.size]
    if not dense:
        return cp.zeros((), np.float32)
    table, n, K = _tile_plan(dense)
    partial = cp.empty((K,), np.float32)
    out = cp.empty((), np.float32)
    _launch("scale", f"sqnorm_multi_tensor_{suffix}", (K,), (256,), (table, np.int32(n), partial))
    _launch("scale", "norm_finish", (1,), (1024,), (partial, np.int64(K), out))
    return out


def scale_multi_tensor(arrays: Sequence[Array], coef: Array) -> None:
    """Multiply every array of ``arrays`` in place by the 0-d ``coef`` (all float32, or all bfloat16, ``coef``
    included), contiguous ones in one launch: the global-norm clip's rescaling of every gradient. ``coef`` is
    read when the kernel runs, so a captured CUDA graph replays with the value computed before it."""
    cp = _cp()
    if not arrays:
        return
    suffix = _same_dtype("scale_multi_tensor", arrays)
    dt = arrays[0].dtype
    if type(coef) is not cp.ndarray or coef.dtype != dt or coef.shape != ():
        raise TensorTypeError(f"scale_multi_tensor: coef must be a 0-d CuPy array of dtype {dt}, got "
                              f"{type(coef).__name__} {getattr(coef, 'dtype', '')} {getattr(coef, 'shape', '')}")
    dense = [a for a in arrays if a.flags.c_contiguous and a.size]
    for a in arrays:
        if not a.flags.c_contiguous:
            a *= coef  # a strided view: scaled where it lies
    if not dense:
        return
    table, n, K = _tile_plan(dense)
    _launch("scale", f"scale_multi_tensor_{suffix}", (K,), (256,), (table, np.int32(n), cp.ascontiguousarray(coef)))


# ops with no generic kernel: this family's part of the package's STANDALONE
STANDALONE: Registry = {
    "scale_multi_tensor": (scale_multi_tensor, ("float32", "bfloat16")),
    "norm_multi_tensor": (norm_multi_tensor, ("float32", "bfloat16")),
}
