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
