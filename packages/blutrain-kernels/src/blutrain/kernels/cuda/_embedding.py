"""Launchers of ``embedding.cu``: the row gather and its backward, deterministic (sorted segments) or atomic
(see :func:`~blutrain.kernels.cuda.set_deterministic`), with the optional scaled addend."""

from __future__ import annotations

from typing import Any

import numpy as np

from blutrain.kernels.cuda._casts import cast
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
    is_deterministic,
    sm_count,
)


def embedding(weight: Array, idx: Array) -> Array | None:
    suffix = _suffix(weight.dtype)
    if suffix is None or weight.ndim != 2 or idx.size == 0 or weight.shape[1] == 0:
        return None
    cp = _cp()
    V, D = int(weight.shape[0]), int(weight.shape[1])
    wc = _contig(weight)
    flat = cp.ascontiguousarray(idx.reshape(-1), dtype=np.int64)
    out = cp.empty((flat.size, D), weight.dtype)
    name, vec = _variant(suffix, D, wc, out)
    threads = min(128, _row_threads(D // vec, hi=128))
    _launch("embedding", f"embedding_fwd_{name}", (flat.size, (D // vec + threads - 1) // threads), (threads,),
            (wc, flat, out, np.int32(D), np.int64(V)))
    return out.reshape((*idx.shape, D))


def embedding_backward(grad: Array, idx: Array, num_embeddings: int, addend: Array | None = None,
                       addend_scale: Array | None = None) -> Array | None:
    """Rows of ``grad`` summed per token id into [num_embeddings, D]: deterministic by default
    (see :func:`set_deterministic`). With ``addend`` (the weight's shape, grad's dtype) and an optional 0-d
    ``addend_scale`` (grad's dtype, read on the device): ``addend * addend_scale + sums``, rounded as the
    separate multiply and add round it (embedding.cu's header), in the same pass that stores the sums."""
    suffix = _suffix(grad.dtype)
    if suffix is None or idx.size == 0 or grad.ndim < 1 or grad.shape[-1] == 0:
        return None
    D = int(grad.shape[-1])
    V = int(num_embeddings)
    if addend is not None and (addend.dtype != grad.dtype or tuple(addend.shape) != (V, D)):
        return None  # the generic kernel names what is wrong
    if addend_scale is not None and (addend is None or addend_scale.dtype != grad.dtype or addend_scale.shape != ()):
        return None
    cp = _cp()
    ac, sc = _contig(addend), _contig(addend_scale)
    flat = cp.ascontiguousarray(idx.reshape(-1), dtype=np.int64)
    ntok = int(flat.size)
    rows = cp.ascontiguousarray(grad).reshape(ntok, D)
    if not is_deterministic():
        acc = cp.zeros((V, D), np.float32)
        _launch("embedding", f"embedding_bwd_atomic_{suffix}", (ntok, max(1, min(8, (D + 255) // 256))), (256,),
                (rows, flat, acc, np.int32(D)))
        if ac is None:
            return acc if suffix == "f32" else cast(acc, grad.dtype)
        total = cp.empty((V, D), grad.dtype)
        blocks = max(1, min(-(-(V * D) // 256), 8 * sm_count()))
        _launch("embedding", f"embedding_bwd_addend_{suffix}", (blocks,), (256,),
                (acc, ac, _ptr(sc), total, np.int64(V * D)))
        return total
    # Unique keys id * ntok + position: any sort gives the same order, so the sum order is fixed.
    keys = cp.sort(flat * ntok + cp.arange(ntok, dtype=np.int64))
    ids = keys // ntok
    pos = cp.ascontiguousarray(keys - ids * ntok)
    seg = cp.searchsorted(ids, cp.arange(V + 1, dtype=np.int64), side="left").astype(np.int64)
    cstart = chunk_starts(cp, seg, SEGMENT_CHUNK)
    partial = cp.empty((chunk_bound(ntok, SEGMENT_CHUNK), D), np.float32)
    out = cp.empty((V, D), grad.dtype)
    name, vec = _variant(suffix, D, rows, out, ac)
    threads, chunks = _column_chunks(D // vec)
    _launch("embedding", f"embedding_bwd_chunks_{name}", (partial.shape[0], chunks), (threads,),
            (rows, pos, seg, cstart, partial, np.int32(D), np.int64(V), np.int32(SEGMENT_CHUNK)))
    _launch("embedding", f"embedding_bwd_sorted_{name}", (-(-V // _SORTED_ROWS), chunks), (threads,),
            (rows, pos, seg, cstart, partial, _ptr(ac), _ptr(sc), out, np.int32(D), np.int64(V)))
    return out


# Positions per block of a long segment in the sorted backward: a row with more is summed by several blocks
# (embedding.cu's embedding_bwd_chunks_*), one chunk each, and its partial sums added in chunk order.
SEGMENT_CHUNK = 64


def chunk_starts(xp: Any, seg: Array, chunk: int) -> Array:
    """``cstart`` (V + 1 int64) for the segment bounds ``seg`` (V + 1, non-decreasing): row v's chunks are
    ``cstart[v] .. cstart[v + 1]``, ceil(length / chunk) of them for a segment longer than ``chunk``
    positions and none for a shorter one (which the sorted kernel sums directly). ``xp``: NumPy or CuPy."""
    lengths = seg[1:] - seg[:-1]
    counts = xp.where(lengths > chunk, (lengths + chunk - 1) // chunk, 0)
    return xp.concatenate((xp.zeros(1, dtype=xp.int64), xp.cumsum(counts, dtype=xp.int64)))


def chunk_bound(ntok: int, chunk: int) -> int:
    """At least the chunks :func:`chunk_starts` can make of ``ntok`` positions (a static grid size, as a
    captured graph needs): a long segment of n > chunk positions has ceil(n / chunk) < 2n / chunk chunks."""
    return max(1, 2 * ntok // chunk)


_SORTED_ROWS = 2  # vocabulary rows per thread of embedding_bwd_sorted_* (EMB_BWD_ROWS in embedding.cu)


def _column_chunks(nvec: int, most: int = 256) -> tuple[int, int]:
    """(threads, chunks) of the sorted backward's grid: the row's ``nvec`` column vectors in as few chunks of
    at most ``most`` threads as cover them, each a multiple of 32 threads (the kernel needs whole warps on one
    vocabulary row) and as even as that allows."""
    chunks = -(-nvec // most)
    per_chunk = -(-nvec // chunks)
    return 32 * -(-per_chunk // 32), chunks


# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {
    "embedding": (embedding, ("float32", "bfloat16")),
    "embedding_backward": (embedding_backward, ("float32", "bfloat16")),
}
