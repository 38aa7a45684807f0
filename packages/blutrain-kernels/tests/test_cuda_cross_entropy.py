"""cross_entropy.cu's cross-entropy forward, backward and fused forward + gradient against the float64 CPU
references.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import DTYPES, check, dev, f64, host, rng

from blutrain.tensor.cpu import nn as cpu_nn

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


CE_CASES = [(6, 1000), (3, 50304), (5, 37)]


def _ce_data(n: int, c: int, dtype: Any, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    r = rng(seed)
    logits = f64(r.standard_normal((n, c)) * 4, dtype)
    target = r.integers(0, c, n).astype(np.int64)
    target[1] = -100
    return logits, target


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("n", "c"), CE_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_forward_matches_float64(dtype: Any, n: int, c: int, reduction: str, smoothing: float) -> None:
    from blutrain.kernels import cuda

    logits, target = _ce_data(n, c, dtype, 5)
    res = cuda.cross_entropy(dev(logits, dtype), dev(target), -100, smoothing, reduction)
    assert res is not None
    rloss, rlse = cpu_nn.cross_entropy(logits, target, -100, smoothing, reduction)
    check(res[0], np.asarray(rloss), dtype)
    check(res[1], rlse, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("n", "c"), CE_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_backward_matches_float64(dtype: Any, n: int, c: int, reduction: str, smoothing: float) -> None:
    from blutrain.kernels import cuda

    logits, target = _ce_data(n, c, dtype, 6)
    _, lse = cpu_nn.cross_entropy(logits, target, -100, smoothing, reduction)
    lse = f64(lse, np.float32)
    grad = f64(rng(7).standard_normal(n if reduction == "none" else ()), dtype)
    out = cuda.cross_entropy_backward(dev(grad, dtype), dev(logits, dtype), dev(target), dev(lse, np.float32), -100,
                                      smoothing, reduction)
    ref = cpu_nn.cross_entropy_backward(grad, logits, target, lse, -100, smoothing, reduction)
    check(out, ref, dtype)


# The fused kernel's row classes: staged whole in shared memory (1000; 50304 in bf16), staged in part with
# the rest re-read (50304 in float32, 65544 in both: past the two-blocks-per-SM budget), the scalar
# fallback (37: no 16-byte vectors).
FUSED_CASES = [(4, 50304), (3, 1000), (2, 65544), (5, 37)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("n", "c"), FUSED_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_grad_fuses_the_backward(dtype: Any, n: int, c: int, reduction: str,
                                                    smoothing: float) -> None:
    from blutrain.kernels import cuda

    logits, target = _ce_data(n, c, dtype, 8)
    target[0] = c - 1  # the one-hot correction in the row's last vector
    res = cuda.cross_entropy_with_grad(dev(logits, dtype), dev(target), -100, smoothing, reduction)
    assert res is not None
    rloss, rlse = cpu_nn.cross_entropy(logits, target, -100, smoothing, reduction)
    check(res[0], np.asarray(rloss), dtype)
    check(res[1], rlse, np.float32)
    ones = np.ones(n if reduction == "none" else ())
    check(res[2], cpu_nn.cross_entropy_backward(ones, logits, target, rlse, -100, smoothing, reduction), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_cross_entropy_with_grad_keeps_a_nan_row_to_itself(dtype: Any) -> None:
    """A row holding a NaN has a NaN log-sum-exp, loss and gradient (the reference's too; the kernel rounds
    such a row in software); the other rows stay within tolerance."""
    from blutrain.kernels import cuda

    logits, target = _ce_data(3, 50304, dtype, 9)
    logits[2, 17] = np.nan
    res = cuda.cross_entropy_with_grad(dev(logits, dtype), dev(target), -100, 0.0, "none")
    assert res is not None
    _, rlse = cpu_nn.cross_entropy(logits, target, -100, 0.0, "none")
    ref = cpu_nn.cross_entropy_backward(np.ones(3), logits, target, rlse, -100, 0.0, "none")
    check(res[2], ref, dtype)
    assert np.isnan(host(res[2])[2]).all() and np.isnan(host(res[1])[2]) and np.isnan(host(res[0])[2])
