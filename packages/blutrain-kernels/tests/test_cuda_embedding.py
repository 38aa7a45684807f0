"""embedding.cu's gather and its deterministic and atomic backward against the CPU references.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import DTYPES, check, dev, f64, host, rng

from blutrain.tensor.cpu import indexing as cpu_ix

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dim", [768, 10])
def test_embedding_forward_gathers_rows(dtype: Any, dim: int) -> None:
    from blutrain.kernels import cuda

    r = rng(10)
    w = f64(r.standard_normal((50, dim)), dtype)
    idx = r.integers(0, 50, (3, 7)).astype(np.int64)
    check(cuda.embedding(dev(w, dtype), dev(idx)), cpu_ix.embedding(w, idx), dtype, tol=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dim", [768, 10])
@pytest.mark.parametrize("deterministic", [True, False])
def test_embedding_backward_sums_rows_per_id(dtype: Any, dim: int, deterministic: bool) -> None:
    from blutrain.kernels import cuda

    r = rng(11)
    idx = r.integers(0, 40, (4, 9)).astype(np.int64)
    idx[0, :5] = 3  # repeats
    g = f64(r.standard_normal((4, 9, dim)), dtype)
    cuda.set_deterministic(deterministic)
    try:
        out = cuda.embedding_backward(dev(g, dtype), dev(idx), 57)
    finally:
        cuda.set_deterministic(True)
    check(out, cpu_ix.embedding_backward(g, idx, 57), dtype)


def test_deterministic_embedding_backward_is_bitwise_reproducible() -> None:
    from blutrain.kernels import cuda

    r = rng(12)
    idx = dev(r.integers(0, 5, 4000).astype(np.int64))
    g = dev(r.standard_normal((4000, 64)).astype(np.float32))
    a, b = host(cuda.embedding_backward(g, idx, 5)), host(cuda.embedding_backward(g, idx, 5))
    assert np.array_equal(a, b)


def _sorted_backward_sums(g: np.ndarray[Any, Any], idx: np.ndarray[Any, Any], vocab: int) -> np.ndarray[Any, Any]:
    """The sums the sorted backward must reproduce bit for bit (before its store rounds them to the gradient's
    dtype), in float32 from +0, one rounding per add: an id with at most SEGMENT_CHUNK positions adds its rows one
    by one in position order; a longer one sums each SEGMENT_CHUNK positions so, then adds those partial sums
    in order."""
    from blutrain.kernels.cuda._embedding import SEGMENT_CHUNK

    rows = g.astype(np.float32).reshape(-1, g.shape[-1])
    flat = idx.reshape(-1)
    acc = np.zeros((vocab, rows.shape[1]), np.float32)
    for token in range(vocab):
        positions = np.flatnonzero(flat == token)  # in position order
        pieces = [positions] if positions.size <= SEGMENT_CHUNK else \
            [positions[i:i + SEGMENT_CHUNK] for i in range(0, positions.size, SEGMENT_CHUNK)]
        for piece in pieces:
            part = np.zeros(rows.shape[1], np.float32)
            for p in piece:
                part = part + rows[p]
            acc[token] = acc[token] + part if len(pieces) > 1 else part
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dim", [768, 1032, 2056, 10, 7])
def test_sorted_embedding_backward_adds_long_segments_in_chunk_order(dtype: Any, dim: int) -> None:
    """Segments of every length class the kernels treat apart: a token at 3000 of 6000 positions (47 chunks of
    64, the last one short), segments of 64 and 65 (the longest summed directly, the shortest summed in two
    chunks), 33 and 37 (past one warp's 32 positions, not a multiple of the 8 rows in flight), 8, 9, single
    and empty rows; an odd vocabulary (the last block's second row is past it); widths of two column chunks
    (1032 float32, 2056 bf16), of the scalar kernels (10, 7). Bit for bit the float32 sums in the sorted
    backward's order, rounded once to the dtype."""
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(13)
    vocab, ntok = 301, 6000
    idx = r.integers(40, vocab, ntok).astype(np.int64)
    slots = r.permutation(ntok)
    idx[slots[:3000]] = 7
    for token, count, start in ((1, 33, 3000), (2, 37, 3033), (3, 8, 3070), (4, 9, 3078), (5, 1, 3087),
                                (6, 64, 3088), (8, 65, 3152)):
        idx[slots[start:start + count]] = token
    g = r.standard_normal((ntok, dim)).astype(dtype)
    out = cuda.embedding_backward(dev(g), dev(idx), vocab)
    want = _sorted_backward_sums(g, idx, vocab).astype(dtype)
    got = np.asarray(cp.asnumpy(out))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # empty rows: +0.0 written
