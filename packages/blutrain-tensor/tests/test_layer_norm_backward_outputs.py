"""The CPU layer_norm_backward's optional outputs (the compiler's layernorm-grad-outputs pass): dx also in a
narrower dtype, and dx's column sums over its leading dims, against float64 references and against the
separate cast and sum kernels they stand for."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor.cpu import nn as cpu_nn
from blutrain.tensor.cpu import reduction as cpu_rd
from blutrain.tensor.cpu.elementwise import cast as cpu_cast

BF16 = bt.bfloat16.np


def _case(seed: int, shape: tuple[int, ...], k: int, affine: bool, addend: bool) -> tuple[Any, ...]:
    """float32 grad, x, weight, the forward's statistics and an addend (or None): the backward's inputs."""
    rng = np.random.default_rng(seed)
    ns = shape[len(shape) - k:]
    x = (rng.standard_normal(shape) * 2 - 0.5).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(ns).astype(np.float32) if affine else None
    a = (rng.standard_normal(shape) * 3).astype(np.float32) if addend else None
    _, mean, rstd = cpu_nn.layer_norm(x, w, None, 1e-5, k)
    return g, x, w, mean, rstd, a


shapes = st.tuples(st.integers(1, 3), st.integers(1, 17), st.integers(1, 40)).flatmap(
    lambda s: st.tuples(st.just(s), st.integers(1, 2)))


@settings(max_examples=40, deadline=None)
@given(shapes, st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_the_optional_outputs_are_the_cast_and_column_sum_of_the_stored_dx(
        case: tuple[tuple[int, ...], int], affine: bool, addend: bool, need_w: bool, need_b: bool,
        seed: int) -> None:
    """The copy is the cast kernel's bits of dx, the sums the sum kernel's bits over dx's leading dims, and
    dx, dweight and dbias are the plain call's; against float64, the sums are within float32 rounding of the
    exact sums of the stored dx and the copy within bf16 rounding of each dx."""
    shape, k = case
    g, x, w, mean, rstd, a = _case(seed, shape, k, affine, addend)
    plain = cpu_nn.layer_norm_backward(g, x, w, mean, rstd, k, need_w, need_b, a)
    out = cpu_nn.layer_norm_backward(g, x, w, mean, rstd, k, need_w, need_b, a, BF16, True)
    assert len(plain) == 3 and len(out) == 5
    np.testing.assert_array_equal(out[0], plain[0])
    for got, want in zip(out[1:3], plain[1:3], strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(got, want)
    copy, total = out[3], out[4]
    assert copy.dtype == BF16 and copy.shape == x.shape
    np.testing.assert_array_equal(copy.view(np.uint16), cpu_cast(plain[0], BF16).view(np.uint16))
    lead = x.ndim - k
    assert total.dtype == np.float32 and total.shape == x.shape[lead:]
    np.testing.assert_array_equal(total, cpu_rd.sum(plain[0], tuple(range(lead)), False))
    # against float64: the sums within n roundings of |dx| summed (n rows), the copy within bf16 rounding
    dx64 = plain[0].astype(np.float64)
    axes = tuple(range(lead))
    n = math.prod(x.shape[:lead])
    assert np.all(np.abs(total - dx64.sum(axis=axes)) <= n * 2.0**-24 * np.abs(dx64).sum(axis=axes))
    assert np.all(np.abs(copy.astype(np.float64) - dx64) <= 2.0**-8 * np.abs(dx64))  # 8 significant bits


@pytest.mark.parametrize(("copy", "total"), [(True, False), (False, True)])
def test_either_output_alone_leaves_the_other_none(copy: bool, total: bool) -> None:
    g, x, w, mean, rstd, a = _case(1, (4, 6), 1, True, True)
    out = cpu_nn.layer_norm_backward(g, x, w, mean, rstd, 1, True, True, a, BF16 if copy else None, total)
    assert len(out) == 5 and (out[3] is not None) == copy and (out[4] is not None) == total


def test_the_copy_of_a_nan_is_the_casts_quiet_nan() -> None:
    """A NaN in a row makes that row's dx NaN: its copy is the cast's (quiet NaN of the sign), its sums NaN."""
    g, x, w, mean, rstd, _ = _case(2, (3, 8), 1, True, False)
    g[0, 0] = np.nan
    out = cpu_nn.layer_norm_backward(g, x, w, mean, rstd, 1, True, True, None, BF16, True)
    np.testing.assert_array_equal(out[3].view(np.uint16), cpu_cast(out[0], BF16).view(np.uint16))
    assert np.isnan(out[4]).all()
