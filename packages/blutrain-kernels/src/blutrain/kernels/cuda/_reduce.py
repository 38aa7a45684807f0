"""Launchers of ``reduce.cu``: column sums in one launch (row chunks' float32 partials added in a fixed order by
the last block of each column tile) and row sums; the column-tile launch plan and scratch that ``gelu.cu``'s
bias + GELU shares."""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from blutrain.kernels.cuda._core import (
    _NULL,
    Array,
    Registry,
    _contig,
    _cp,
    _launch,
    _numel,
    _row_threads,
    _suffix,
    _variant,
    sm_count,
)
from blutrain.kernels.cuda._plans import _unpooled, _upload

# Block of the column-tile kernels (sum_cols_*, bias_gelu_*): 32 column vectors x 16 row lanes; about two
# blocks per SM, each keeping 8 x 16 bytes of loads in flight per thread, saturate HBM.
_COL_LANES = 16
_COL_BLOCK = (32, _COL_LANES)
# Scratch of the one-launch column sums, per (device, stream): float32 partials and per-tile ticket
# counters, which are zero between launches (the last block of a tile resets its own). Launches on one
# stream run in order, so they share it; it is allocated once and never freed, so a captured CUDA graph
# may keep its pointers. A plan needs at most about 4 * SMs * 256 floats of it.
_SCRATCH_FLOATS = 1 << 19
_SCRATCH_TILES = 1 << 12
_scratch: dict[tuple[int, int], tuple[Array, Array]] = {}
_col_plans: dict[tuple[int, int, int, int, int], tuple[int, int, int]] = {}


def _column_plan(dev: int, N: int, nv: int, vec: int, rows_min: int) -> tuple[int, int, int]:
    """(column tiles, row chunks, rows per chunk) of a column-tile launch over N rows of ``nv`` vectors:
    about two blocks per SM, chunks of whole multiples of ``rows_min`` rows (a block's unrolled loads), and
    no more partials than the scratch holds."""
    key = (dev, N, nv, vec, rows_min)
    plan = _col_plans.get(key)
    if plan is None:
        tiles = (nv + 31) // 32
        chunks = max(1, min((2 * sm_count() + tiles - 1) // tiles, (N + rows_min - 1) // rows_min))
        if tiles > _SCRATCH_TILES:
            chunks = 1
        chunks = min(chunks, max(1, _SCRATCH_FLOATS // (tiles * 32 * vec)))
        per_chunk = (N + chunks - 1) // chunks
        rows_per = (per_chunk + rows_min - 1) // rows_min * rows_min
        plan = (tiles, (N + rows_per - 1) // rows_per, rows_per)
        if len(_col_plans) >= 4096:
            _col_plans.clear()
        _col_plans[key] = plan
    return plan


def _column_scratch(dev: int) -> tuple[Array, Array]:
    """(float32 partials, uint32 tile counters) of the current stream of device ``dev``.

    The scratch is device memory of its own, outside every pool, and lives as long as its stream: a
    compiled step's executor runs on a stream of its own and first needs it while it records into its private
    pool, which must not keep a block for the rest of the process (nor hand one to a graph that outlives it)."""
    cp = _cp()
    stream = cp.cuda.get_current_stream()
    key = (dev, stream.ptr)
    found = _scratch.get(key)
    if found is None:
        # The counters start at zero, written from the host on a side stream: a fill on this stream would be
        # recorded, not run, while it captures a graph.
        found = _scratch[key] = (_unpooled((_SCRATCH_FLOATS,), np.float32),
                                 _upload(np.zeros(_SCRATCH_TILES, np.uint32), capturing=True))
        if stream.ptr != 0:  # the default stream is never destroyed
            with contextlib.suppress(TypeError):  # a stream type without weak references: kept for good
                weakref.finalize(stream, _scratch.pop, key, None)
    return found


def sum_cols(x: Array) -> Array | None:
    """Column sums of a 2-D [N, D] array (the bias gradient) in one launch, float accumulation, deterministic."""
    suffix = _suffix(x.dtype)
    if suffix is None or x.ndim != 2 or x.size == 0 or x.shape[1] >= 2**31:
        return None
    cp = _cp()
    N, D = x.shape
    xc = _contig(x)
    out = cp.empty((D,), x.dtype)
    name, vec = _variant(suffix, D, xc)
    dev = cp.cuda.runtime.getDevice()
    tiles, chunks, rows_per = _column_plan(dev, N, D // vec, vec, 8 * _COL_LANES)
    partial, counters = _column_scratch(dev) if chunks > 1 else (_NULL, _NULL)
    _launch("reduce", f"sum_cols_{name}", (tiles, chunks), _COL_BLOCK,
            (xc, out, partial, counters, np.int64(N), np.int32(D), np.int64(rows_per)))
    return out


def sum_rows(x: Array) -> Array | None:
    """Row sums of a 2-D [N, D] array, float accumulation, deterministic."""
    suffix = _suffix(x.dtype)
    if suffix is None or x.ndim != 2 or x.size == 0 or x.shape[1] >= 2**31:
        return None
    cp = _cp()
    N, D = int(x.shape[0]), int(x.shape[1])
    xc = _contig(x)
    out = cp.empty((N,), x.dtype)
    name, vec = _variant(suffix, D, xc)
    _launch("reduce", f"sum_rows_{name}", (N,), (_row_threads(D // vec),), (xc, out, np.int32(D)))
    return out


def sum(a: Array, axes: tuple[int, ...] | None, keepdim: bool) -> Array | None:
    """``a.sum(axes)`` when the axes are the leading or the trailing dims of ``a``."""
    if _suffix(a.dtype) is None or a.size == 0 or a.ndim == 0 or not axes:
        return None
    ax = tuple(sorted(x % a.ndim for x in axes))
    j = len(ax)
    if ax == tuple(range(j)):
        out = sum_cols(a.reshape(_numel(a.shape[:j]), _numel(a.shape[j:])))
        kept = tuple(1 if i < j else s for i, s in enumerate(a.shape))
        rest = a.shape[j:]
    elif ax == tuple(range(a.ndim - j, a.ndim)):
        out = sum_rows(a.reshape(_numel(a.shape[: a.ndim - j]), _numel(a.shape[a.ndim - j:])))
        kept = tuple(1 if i >= a.ndim - j else s for i, s in enumerate(a.shape))
        rest = a.shape[: a.ndim - j]
    else:
        return None
    if out is None:
        return None
    return out.reshape(kept if keepdim else rest)


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "sum": (sum, ("float32", "bfloat16")),
}
