"""reduce.cu's column and row sums against the float64 CPU references, and their reproducibility.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import DTYPES, check, dev, f64, host, rng

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "axes"), [((1000, 768), (0,)), ((3, 4, 5), (0, 1)), ((3, 4, 5), (1, 2)),
                                             ((3, 4, 5), (2,)), ((70, 33), (0,)), ((2, 4096), (1,))])
@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_over_leading_or_trailing_axes_matches_float64(dtype: Any, shape: tuple[int, ...], axes: tuple[int, ...],
                                                           keepdim: bool) -> None:
    from blutrain.kernels import cuda

    x = f64(rng(13).standard_normal(shape), dtype)
    check(cuda.sum(dev(x, dtype), axes, keepdim), x.sum(axis=axes, keepdims=keepdim), dtype)


def test_sum_over_middle_axes_is_left_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    assert cuda.sum(dev(np.ones((3, 4, 5), np.float32)), (1,), False) is None


# One launch: (3000, 768), (5000, 40), (20000, 96) split rows into many chunks whose partials the last
# block of each column tile adds; (300, 50304) has one chunk per tile; (129, 4097), (9, 5) odd widths.
SUM_COLS_SHAPES = [(1, 5), (9, 5), (3, 768), (3000, 768), (5000, 40), (20000, 96), (129, 4097), (300, 50304)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SUM_COLS_SHAPES)
def test_sum_cols_matches_float64(dtype: Any, shape: tuple[int, int]) -> None:
    from blutrain.kernels import cuda

    x = f64(rng(17).standard_normal(shape), dtype)
    check(cuda.sum_cols(dev(x, dtype)), x.sum(axis=0), dtype)


def test_sum_cols_of_unaligned_rows_uses_the_scalar_path() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    flat = rng(18).standard_normal(1 + 2000 * 64).astype(np.float32)
    x = cp.asarray(flat)[1:].reshape(2000, 64)  # 4-byte offset: no 16-byte loads
    check(cuda.sum_cols(x), flat[1:].reshape(2000, 64).astype(np.float64).sum(axis=0), np.float32)


def test_column_sums_are_reproducible_across_launches_streams_and_kernels() -> None:
    """Every launch leaves the tile counters at zero for the next (else a tile's sum goes unwritten)."""
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(19)
    a, b = r.standard_normal((3000, 768)).astype(np.float32), r.standard_normal((5000, 40)).astype(np.float32)
    first = [host(cuda.sum_cols(dev(a))), host(cuda.sum_cols(dev(b)))]
    for _ in range(3):
        g = dev(r.standard_normal((2000, 768)).astype(np.float32))
        res = cuda.bias_gelu_backward(g, g, dev(np.zeros(768, np.float32)), "tanh", True)  # shares the scratch
        assert res is not None
        with cp.cuda.Stream():
            assert np.array_equal(host(cuda.sum_cols(dev(b))), first[1])
        assert np.array_equal(host(cuda.sum_cols(dev(a))), first[0])
        assert np.array_equal(host(cuda.sum_cols(dev(b))), first[1])
    check(cp.asarray(first[0]), a.astype(np.float64).sum(axis=0), np.float32)
