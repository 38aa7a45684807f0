"""gelu.cu's GELU and bias + GELU, forward and backward, against the float64 CPU references.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import DTYPES, check, dev, f64, rng

from blutrain.tensor.cpu import nn as cpu_nn
from blutrain.tensor.cpu.elementwise import gelu as cpu_gelu
from blutrain.tensor.cpu.elementwise import gelu_backward as cpu_gelu_backward

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(4096,), (4099,), (3, 5, 7), (1,)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_forward_and_backward_match_float64(dtype: Any, shape: tuple[int, ...], approximate: str) -> None:
    from blutrain.kernels import cuda

    r = rng(3)
    x = f64(r.standard_normal(shape) * 3, dtype)
    g = f64(r.standard_normal(shape), dtype)
    check(cuda.gelu(dev(x, dtype), approximate), cpu_gelu(x, approximate), dtype)
    check(cuda.gelu_backward(dev(g, dtype), dev(x, dtype), approximate), cpu_gelu_backward(g, x, approximate), dtype)


def test_gelu_of_an_unaligned_view_uses_the_scalar_path() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    x = rng(4).standard_normal(1001).astype(np.float32)
    view = cp.asarray(x)[1:]  # 4-byte offset: no 16-byte loads
    check(cuda.gelu(view, "tanh"), cpu_gelu(x[1:].astype(np.float64), "tanh"), np.float32)


# (2000, 768), (5000, 40): many row chunks whose bias partials the last block of each column tile adds;
# (7, 33), (3, 5, 1001): odd widths (no 16-byte accesses); (40, 50304): one row chunk per tile.
BIAS_GELU_SHAPES = [(4, 768), (3, 5, 1001), (2000, 768), (7, 33), (1, 8), (300, 3072), (5000, 40), (40, 50304)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", BIAS_GELU_SHAPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_forward_and_backward_match_float64(dtype: Any, shape: tuple[int, ...], approximate: str) -> None:
    from blutrain.kernels import cuda

    r = rng(14)
    x = f64(r.standard_normal(shape) * 2, dtype)
    b = f64(r.standard_normal(shape[-1]), dtype)
    g = f64(r.standard_normal(shape), dtype)
    check(cuda.bias_gelu(dev(x, dtype), dev(b, dtype), approximate), cpu_nn.bias_gelu(x, b, approximate), dtype)
    res = cuda.bias_gelu_backward(dev(g, dtype), dev(x, dtype), dev(b, dtype), approximate, True)
    assert res is not None
    rdx, rdb = cpu_nn.bias_gelu_backward(g, x, b, approximate, True)
    check(res[0], rdx, dtype)
    check(res[1], rdb, dtype)


def test_bias_gelu_backward_without_the_bias_gradient_writes_dx_only() -> None:
    from blutrain.kernels import cuda

    r = rng(15)
    x, b, g = r.standard_normal((300, 96)), r.standard_normal(96), r.standard_normal((300, 96))
    res = cuda.bias_gelu_backward(dev(g, np.float32), dev(x, np.float32), dev(b, np.float32), "tanh", False)
    assert res is not None and res[1] is None
    check(res[0], cpu_nn.bias_gelu_backward(g, x, b, "tanh", False)[0], np.float32)


def test_bias_gelu_of_unaligned_rows_uses_the_scalar_path() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(16)
    flat, b, g = r.standard_normal(1 + 50 * 64), r.standard_normal(64), r.standard_normal((50, 64))
    x = cp.asarray(flat.astype(np.float32))[1:].reshape(50, 64)  # 4-byte offset: no 16-byte accesses
    xr = flat[1:].reshape(50, 64).astype(np.float32).astype(np.float64)
    check(cuda.bias_gelu(x, dev(b, np.float32), "tanh"), cpu_nn.bias_gelu(xr, b, "tanh"), np.float32)
    res = cuda.bias_gelu_backward(dev(g, np.float32), x, dev(b, np.float32), "tanh", True)
    assert res is not None
    rdx, rdb = cpu_nn.bias_gelu_backward(g, xr, b, "tanh", True)
    check(res[0], rdx, np.float32)
    check(res[1], rdb, np.float32)
