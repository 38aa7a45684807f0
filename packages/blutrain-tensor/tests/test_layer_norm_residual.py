"""The CPU layer_norm's residual operand (the compiler's layernorm-residual pass): s = residual + x normalized,
s returned; against float64 and against the separate add and layer_norm kernels it stands for."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor.cpu import nn as cpu_nn
from blutrain.tensor.cpu.elementwise import add as cpu_add
from blutrain.tensor.cpu.elementwise import cast as cpu_cast

BF16 = bt.bfloat16.np

shapes = st.tuples(st.integers(1, 3), st.integers(1, 17), st.integers(1, 40)).flatmap(
    lambda s: st.tuples(st.just(s), st.integers(1, 2)))


def _bits(a: Any) -> Any:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _case(seed: int, shape: tuple[int, ...], k: int, affine: bool, x_dtype: Any) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    ns = shape[len(shape) - k:]
    x = (rng.standard_normal(shape) * 0.5).astype(x_dtype)
    r = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    w, b = ((rng.standard_normal(ns).astype(np.float32) if affine else None) for _ in range(2))
    return x, r, w, b


@settings(max_examples=40, deadline=None)
@given(shapes, st.booleans(), st.sampled_from([BF16, np.dtype(np.float32)]), st.sampled_from([None, BF16]),
       st.integers(0, 2**16))
def test_the_residual_layernorm_is_the_add_then_the_layernorm_bit_for_bit(case: tuple[tuple[int, ...], int],
                                                                          affine: bool, x_dtype: Any,
                                                                          out_dtype: Any, seed: int) -> None:
    """s is the float32 add of the residual and the widened x (eager's cast then add), and y, mean, rstd are the
    plain layer_norm's of s: the same bits."""
    shape, k = case
    x, r, w, b = _case(seed, shape, k, affine, x_dtype)
    y, mean, rstd, s = cpu_nn.layer_norm(x, w, b, 1e-5, k, out_dtype, residual=r)
    s_ref = cpu_add(r, cpu_cast(x, np.float32))
    y_ref, mean_ref, rstd_ref = cpu_nn.layer_norm(s_ref, w, b, 1e-5, k, out_dtype)
    assert s.dtype == np.float32 and y.dtype == (np.float32 if out_dtype is None else out_dtype)
    for got, want in ((s, s_ref), (y, y_ref), (mean, mean_ref), (rstd, rstd_ref)):
        assert got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))


@settings(max_examples=20, deadline=None)
@given(shapes, st.booleans(), st.integers(0, 2**16))
def test_the_residual_layernorm_matches_float64(case: tuple[tuple[int, ...], int], affine: bool, seed: int) -> None:
    shape, k = case
    x, r, w, b = _case(seed, shape, k, affine, BF16)
    y, mean, _, s = cpu_nn.layer_norm(x, w, b, 1e-5, k, residual=r)
    s64 = r.astype(np.float64) + x.astype(np.float64)
    rows = s64.reshape(-1, int(np.prod(shape[len(shape) - k:])))
    m = rows.mean(axis=1, keepdims=True)
    v = ((rows - m) ** 2).mean(axis=1, keepdims=True)
    y64 = ((rows - m) / np.sqrt(v + 1e-5)).reshape(shape)
    if w is not None:
        y64 = y64 * w + b
    np.testing.assert_allclose(s, s64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, y64, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mean.reshape(-1), m.reshape(-1), rtol=1e-5, atol=1e-5)


def test_a_nan_in_x_or_the_residual_is_nan_in_s_and_its_row() -> None:
    x, r, w, b = _case(0, (3, 8), 1, True, BF16)
    x[1, 2] = np.nan
    r[2, 5] = np.nan
    y, _, _, s = cpu_nn.layer_norm(x, w, b, 1e-5, 1, residual=r)
    assert np.isnan(s[1, 2]) and np.isnan(s[2, 5]) and np.isfinite(s[0]).all()
    assert np.isnan(y[1:]).all() and np.isfinite(y[0]).all()
