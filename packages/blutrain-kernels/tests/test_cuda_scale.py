"""scale.cu's multi-tensor scale and global norm against one multiply per tensor and the float64 norm.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, DTYPES

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_scale_multi_tensor_equals_one_multiply_per_tensor_bit_for_bit(dtype: Any) -> None:
    """Sizes around the 4096-element tile, an empty array and a strided view (scaled where it lies), all in one
    call; every element equals the float product of the widened operands rounded once (NumPy/ml_dtypes)."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(0)
    sizes = [1, 3, 4095, 4096, 4097, 10_000, 0, 50_304]
    hosts = [rng.standard_normal(n).astype(dtype) for n in sizes]
    arrays = [cp.asarray(h) for h in hosts]
    base = cp.asarray(rng.standard_normal((64, 48)).astype(dtype))
    strided = base[:, ::3]
    before_base = cp.asnumpy(base)
    coef = np.array(0.37109375, dtype)
    cuda.scale_multi_tensor([*arrays, strided], cp.asarray(coef))
    for h, a in zip(hosts, arrays, strict=True):
        want = (h.astype(np.float32) * coef.astype(np.float32)).astype(dtype)
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), want.view(np.uint8))
    want_base = before_base.copy()
    want_base[:, ::3] = (before_base[:, ::3].astype(np.float32) * coef.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(cp.asnumpy(base).view(np.uint8), want_base.view(np.uint8))


def test_scale_multi_tensor_in_a_captured_graph_reads_each_replays_coefficient() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    xs = [cp.ones(n, np.float32) for n in (5, 9000)]
    coef = cp.asarray(np.float32(0.5))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cuda.scale_multi_tensor(xs, coef)  # the plan is built (and cached) outside the capture first
        stream.begin_capture()
        cuda.scale_multi_tensor(xs, coef)
        graph = stream.end_capture()
        coef[...] = 0.25
        graph.launch(stream)
        coef[...] = 2.0
        graph.launch(stream)
    stream.synchronize()
    for x in xs:
        np.testing.assert_array_equal(cp.asnumpy(x), np.full(x.size, 0.5 * 0.25 * 2.0, np.float32))


def test_scale_multi_tensor_rejects_mixed_dtypes_and_a_coefficient_of_another_dtype() -> None:
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.tensor.errors import TensorTypeError

    a, b = cp.ones(4, np.float32), cp.ones(4, BF16)
    with pytest.raises(TensorTypeError, match="array 1 must be a CuPy array of dtype float32"):
        cuda.scale_multi_tensor([a, b], cp.asarray(np.float32(2)))
    with pytest.raises(TensorTypeError, match="coef must be a 0-d CuPy array of dtype float32"):
        cuda.scale_multi_tensor([a], cp.asarray(np.float64(2)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_norm_multi_tensor_matches_float64_over_tiles_empty_and_strided_arrays(dtype: Any) -> None:
    """The clip's norm over sizes around the 4096-element tile, an empty array and a strided view, against
    the float64 norm of the same values; the same value again (fixed summation order); and in a captured
    graph, reading each replay's values."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(1)
    sizes = [1, 3, 4095, 4096, 4097, 10_000, 0, 50_304]
    hosts = [rng.standard_normal(n).astype(dtype) for n in sizes]
    base = rng.standard_normal((64, 48)).astype(dtype)
    arrays = [*(cp.asarray(h) for h in hosts), cp.asarray(base)[:, ::3]]
    values = np.concatenate([*(h.astype(np.float64) for h in hosts), base[:, ::3].astype(np.float64).ravel()])
    want = float(np.linalg.norm(values))
    got = cuda.norm_multi_tensor(arrays)
    assert got.dtype == np.float32 and got.shape == ()
    assert abs(float(got) - want) <= 1e-6 * want
    assert float(cuda.norm_multi_tensor(arrays)) == float(got)
    assert float(cuda.norm_multi_tensor([cp.zeros(0, dtype)])) == 0.0
    dense = arrays[:6]
    stream = cp.cuda.Stream(non_blocking=True)
    # the kernel allocates its partial sums and result: from a pool that holds the blocks before the capture
    # (a cudaMalloc inside a capture breaks it, and memcheck runs with CuPy's pool off)
    pool = cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(pool.malloc):
        cuda.norm_multi_tensor(dense)  # the plan is built (and cached), the pool filled, outside the capture
        stream.synchronize()
        stream.begin_capture()
        out = cuda.norm_multi_tensor(dense)
        graph = stream.end_capture()
        for a in dense:
            a *= 2
        graph.launch(stream)
    stream.synchronize()
    twice = 2 * float(np.linalg.norm(np.concatenate([h.astype(np.float64) for h in hosts[:6]])))
    assert abs(float(out) - twice) <= 1e-6 * twice
