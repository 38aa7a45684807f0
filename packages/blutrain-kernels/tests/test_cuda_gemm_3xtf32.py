"""The 3xTF32 tensor-core GEMM (gemm_3xtf32.cu) against float64 NumPy: float32 accuracy in every layout.

Layouts are named as the cuda backend's ``gemm_into`` flags: "nt" is a linear layer's forward x Wᵀ
(``trans_b``), "nn" its input gradient dy W, "tn" its weight gradient dyᵀ x (``trans_a``), "tt" both.
Every device allocation starts as 0xFF bytes (NaN) and outputs that are not accumulated into are NaN,
so an element the kernel (or its split-K workspace) forgets to write fails. Skipped without an NVIDIA GPU
and CuPy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from blutrain.tensor.errors import ShapeError

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

LAYOUTS = {"nt": (False, True), "nn": (False, False), "tn": (True, False), "tt": (True, True)}
ODD = (1, 7, 65, 129, 1000)
# Each odd size in each dim (the others odd too), and a few mixes: edge tiles in M, N and K at once.
ODD_SHAPES = sorted({(v, 129, 65) for v in ODD} | {(65, v, 129) for v in ODD} | {(129, 65, v) for v in ODD}
                    | {(1, 1, 1), (7, 7, 7), (1000, 1000, 1000), (1000, 7, 129), (7, 1000, 1), (129, 1, 1000)})
FP32_LEVEL = 2e-6  # relative (Frobenius) error of float32 arithmetic over K in the thousands


@pytest.fixture(autouse=True)
def strict_cublas() -> Iterator[None]:
    """CuPy's float32 matmul as strict float32 cuBLAS (no TF32) while a test runs; the setting is put back."""
    from cupy._core import _routines_linalg as linalg

    before = linalg.get_compute_type(np.float32)
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_FP32)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, before)


def operands(M: int, N: int, K: int, layout: str, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Standard-normal float32 a, b stored as the layout's flags say ([K, M] for trans_a, [N, K] for trans_b)."""
    trans_a, trans_b = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    return a, b


def reference(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], layout: str) -> np.ndarray[Any, Any]:
    trans_a, trans_b = LAYOUTS[layout]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)


def rel_err(out: Any, ref: np.ndarray[Any, Any]) -> float:
    import cupy as cp

    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "non-finite output: an element was not written"
    return float(np.linalg.norm(got - ref)) / max(float(np.linalg.norm(ref)), 1e-30)


def run(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], layout: str, out: Any = None,
        accumulate: bool = False) -> Any:
    """Our GEMM on device copies of a and b, into ``out`` (or a NaN-filled new one); forced past the
    too-small-to-pay threshold."""
    import cupy as cp

    from blutrain.kernels import cuda

    trans_a, trans_b = LAYOUTS[layout]
    M = a.shape[1] if trans_a else a.shape[0]
    N = b.shape[0] if trans_b else b.shape[1]
    if out is None:
        out = cp.full((M, N), np.nan, np.float32)
    done = cuda.gemm_3xtf32(cp.asarray(a), cp.asarray(b), out, trans_a, trans_b, accumulate, min_flops=0)
    assert done, "gemm_3xtf32 declined a contiguous float32 product"
    return out


def cublas(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], layout: str) -> Any:
    """The same product through CuPy's strict float32 cuBLAS (transposes as views: cuBLAS's own flags)."""
    import cupy as cp

    trans_a, trans_b = LAYOUTS[layout]
    da, db = cp.asarray(a), cp.asarray(b)
    return cp.matmul(da.T if trans_a else da, db.T if trans_b else db)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("K", [768, 3072])
def test_error_is_at_the_float32_level_and_within_twice_cublas(layout: str, K: int) -> None:
    a, b = operands(512, 384, K, layout, seed=K)
    ref = reference(a, b, layout)
    ours, theirs = rel_err(run(a, b, layout), ref), rel_err(cublas(a, b, layout), ref)
    assert ours <= FP32_LEVEL, f"3xTF32 error {ours:.2e} (cuBLAS fp32 {theirs:.2e})"
    assert ours <= 2 * theirs, f"3xTF32 error {ours:.2e} is over twice cuBLAS fp32's {theirs:.2e}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("M", "N", "K"), ODD_SHAPES)
def test_every_layout_handles_odd_sizes(layout: str, M: int, N: int, K: int) -> None:
    a, b = operands(M, N, K, layout, seed=M * 1_000_003 + N * 1009 + K)
    assert rel_err(run(a, b, layout), reference(a, b, layout)) <= FP32_LEVEL


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("M", "N", "K"), [(129, 65, 1000), (256, 384, 768), (7, 1000, 65)])
def test_accumulate_adds_the_product_to_out(layout: str, M: int, N: int, K: int) -> None:
    import cupy as cp

    a, b = operands(M, N, K, layout, seed=7)
    c0 = np.random.default_rng(8).standard_normal((M, N)).astype(np.float32)
    out = run(a, b, layout, out=cp.asarray(c0), accumulate=True)
    assert rel_err(out, c0.astype(np.float64) + reference(a, b, layout)) <= FP32_LEVEL


@pytest.mark.parametrize("accumulate", [False, True])
def test_split_k_weight_gradient_is_accurate_and_bitwise_reproducible(accumulate: bool) -> None:
    """A weight gradient with few output tiles and a long K (768 x 768 over 8192 tokens) is split over K;
    the partials are added in a fixed order."""
    import cupy as cp

    a, b = operands(768, 768, 8192, "tn", seed=3)
    c0 = np.random.default_rng(4).standard_normal((768, 768)).astype(np.float32)
    ref = reference(a, b, "tn") + (c0.astype(np.float64) if accumulate else 0.0)
    first = run(a, b, "tn", out=cp.asarray(c0) if accumulate else None, accumulate=accumulate)
    second = run(a, b, "tn", out=cp.asarray(c0) if accumulate else None, accumulate=accumulate)
    assert rel_err(first, ref) <= FP32_LEVEL
    assert cp.array_equal(first, second)


def test_an_unaligned_operand_takes_the_4_byte_path() -> None:
    """Rows that start off a 16-byte boundary (a view one float into its buffer) are read 4 bytes at a time."""
    import cupy as cp

    from blutrain.kernels import cuda

    a, b = operands(200, 136, 256, "nt", seed=5)
    buf = cp.empty(a.size + 1, np.float32)
    da = buf[1:].reshape(a.shape)
    da[...] = cp.asarray(a)
    out = cp.full((200, 136), np.nan, np.float32)
    assert cuda.gemm_3xtf32(da, cp.asarray(b), out, False, True, min_flops=0)
    assert rel_err(out, reference(a, b, "nt")) <= FP32_LEVEL


def test_empty_k_writes_zeros_or_leaves_an_accumulated_out() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    a, b = cp.empty((5, 0), np.float32), cp.empty((0, 3), np.float32)
    out = cp.full((5, 3), np.nan, np.float32)
    assert cuda.gemm_3xtf32(a, b, out, min_flops=0)
    assert (out == 0).all()
    out = cp.ones((5, 3), np.float32)
    assert cuda.gemm_3xtf32(a, b, out, accumulate=True, min_flops=0)
    assert (out == 1).all()


def test_declines_other_dtypes_strided_views_and_small_products() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    a, b = cp.ones((256, 256), np.float32), cp.ones((256, 256), np.float32)
    out = cp.full((256, 256), 7.0, np.float32)
    assert not cuda.gemm_3xtf32(a.astype(np.float64), b, out, min_flops=0)
    assert not cuda.gemm_3xtf32(a, b, out.astype(np.float64), min_flops=0)
    assert not cuda.gemm_3xtf32(cp.ones((256, 512), np.float32)[:, ::2], b, out, min_flops=0)
    small = cp.ones((64, 64), np.float32)
    small_out = cp.full((64, 64), 7.0, np.float32)
    assert not cuda.gemm_3xtf32(small, small, small_out)  # 2 * 64^3 FLOPs: too small to pay
    assert (out == 7.0).all() and (small_out == 7.0).all()


def test_operands_that_do_not_fit_out_are_a_shape_error() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    with pytest.raises(ShapeError, match="out must be"):
        cuda.gemm_3xtf32(cp.ones((4, 8), np.float32), cp.ones((8, 5), np.float32), cp.empty((4, 6), np.float32))
    with pytest.raises(ShapeError, match="op\\(b\\) 9x5"):
        cuda.gemm_3xtf32(cp.ones((4, 8), np.float32), cp.ones((9, 5), np.float32), cp.empty((4, 5), np.float32))
