"""softmax.cu's softmax and log-softmax, forward and backward, against the float64 CPU references.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import DTYPES, check, dev, f64, rng

from blutrain.tensor.cpu import reduction as cpu_rd

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(4, 1000), (3, 7), (2, 3, 64)])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_forward_and_backward_match_float64(dtype: Any, shape: tuple[int, ...], log: bool) -> None:
    from blutrain.kernels import cuda

    r = rng(9)
    x = f64(r.standard_normal(shape) * 5, dtype)
    x[..., 0, 1] = -np.inf  # a masked entry
    g = f64(r.standard_normal(shape), dtype)
    fwd = cuda.log_softmax if log else cuda.softmax
    bwd = cuda.log_softmax_backward if log else cuda.softmax_backward
    ref = (cpu_rd.log_softmax if log else cpu_rd.softmax)(x, -1)
    check(fwd(dev(x, dtype), -1), ref, dtype)
    y = f64(ref, dtype)
    check(bwd(dev(g, dtype), dev(y, dtype), -1),
          (cpu_rd.log_softmax_backward if log else cpu_rd.softmax_backward)(g, y, -1), dtype)


def test_softmax_over_another_axis_is_left_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    assert cuda.softmax(dev(np.ones((3, 4), np.float32)), 0) is None
