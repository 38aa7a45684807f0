"""The host side of the sorted embedding backward's long segments (_embedding.chunk_starts / chunk_bound), on
NumPy: every segment longer than the chunk is tiled, in position order, by the chunks the kernel's blocks find
by binary search, and the grid bound holds whatever the segment lengths."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.kernels.cuda._embedding import chunk_bound, chunk_starts


def _row_of(cstart: np.ndarray, block: int) -> int:
    """embedding.cu's chunk_bounds search: the r with cstart[r] <= block < cstart[r + 1]."""
    lo, hi = 0, cstart.size - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cstart[mid] <= block:
            lo = mid
        else:
            hi = mid
    return lo


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=40), chunk=st.sampled_from([1, 8, 64]))
def test_long_segments_are_tiled_by_their_chunks_in_order(lengths: list[int], chunk: int) -> None:
    seg = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    cstart = chunk_starts(np, seg, chunk)
    assert cstart.dtype == np.int64 and cstart.shape == seg.shape and cstart[0] == 0
    assert int(cstart[-1]) <= chunk_bound(int(seg[-1]), chunk)
    covered: dict[int, list[tuple[int, int]]] = {}
    for block in range(int(cstart[-1])):
        row = _row_of(cstart, block)
        assert cstart[row] <= block < cstart[row + 1]
        begin = int(seg[row] + (block - cstart[row]) * chunk)
        end = min(begin + chunk, int(seg[row + 1]))
        covered.setdefault(row, []).append((begin, end))
    for row, n in enumerate(lengths):
        if n <= chunk:
            assert row not in covered  # summed directly by the sorted kernel, in position order
            continue
        pieces = covered[row]
        assert pieces[0][0] == seg[row] and pieces[-1][1] == seg[row + 1]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
        assert all(0 < e - b <= chunk for b, e in pieces)


def test_the_grid_bound_is_at_least_one_block() -> None:
    assert chunk_bound(0, 64) == 1 and chunk_bound(63, 64) == 1 and chunk_bound(16384, 64) == 512
