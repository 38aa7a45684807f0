"""LR schedules and global-norm clipping against direct formulas."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain import nn
from blutrain.optim import OptimizerError, clip_grad_norm_, constant, global_norm, scale_, warmup_cosine
from blutrain.tensor import float64, from_numpy


def test_warmup_rises_linearly_to_the_peak() -> None:
    lrs = [warmup_cosine(s, 1.0, 4, 20, 0.1) for s in range(4)]
    assert lrs == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_from_the_peak_to_the_floor_and_stays_there() -> None:
    assert warmup_cosine(4, 1.0, 4, 20, 0.1) == 1.0
    mid = warmup_cosine(12, 1.0, 4, 20, 0.1)
    assert math.isclose(mid, 0.1 + 0.5 * 0.9)
    lrs = [warmup_cosine(s, 1.0, 4, 20, 0.1) for s in range(4, 20)]
    assert all(a > b for a, b in itertools.pairwise(lrs))
    assert warmup_cosine(20, 1.0, 4, 20, 0.1) == 0.1 and warmup_cosine(500, 1.0, 4, 20, 0.1) == 0.1


def test_no_warmup_starts_at_the_peak() -> None:
    assert warmup_cosine(0, 3e-4, 0, 100, 3e-5) == 3e-4


def test_schedule_arguments_are_checked() -> None:
    with pytest.raises(OptimizerError, match=r"min_lr \(2\.0\) must not exceed max_lr \(1\.0\)"):
        warmup_cosine(0, 1.0, 0, 10, 2.0)
    with pytest.raises(OptimizerError, match="step must be an int >= 0, got -1"):
        warmup_cosine(-1, 1.0, 0, 10)


def test_constant_schedule_with_optional_warmup() -> None:
    assert [constant(s, 0.2) for s in (0, 5, 99)] == [0.2, 0.2, 0.2]
    assert [constant(s, 1.0, warmup_steps=2) for s in range(3)] == [0.5, 1.0, 1.0]


def _params_with_grads(grads: list[np.ndarray]) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(from_numpy(np.zeros_like(g)))
        p.grad = from_numpy(g.copy())
        params.append(p)
    return params


def test_clip_scales_every_gradient_by_the_global_norm() -> None:
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=s) for s in ((3, 4), (5,), (2, 2, 2))]
    params = _params_with_grads(grads)
    total = np.sqrt(sum((g**2).sum() for g in grads))
    norm = clip_grad_norm_(params, 1.0)
    assert norm.ndim == 0 and norm.dtype is float64
    assert math.isclose(float(norm), total, rel_tol=1e-12)
    for p, g in zip(params, grads, strict=True):
        assert p.grad is not None
        np.testing.assert_allclose(np.asarray(p.grad), g / (total + 1e-6), rtol=1e-12)


def test_clip_takes_the_norm_over_gradients_of_several_dtypes_in_the_widest() -> None:
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=(3, 5)), rng.normal(size=7).astype(np.float32), rng.normal(size=(2, 3))]
    params = _params_with_grads(grads)
    total = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads))
    norm = clip_grad_norm_(params, 0.5)
    assert norm.dtype is float64
    assert math.isclose(float(norm), total, rel_tol=1e-7)
    for p, g in zip(params, grads, strict=True):
        assert p.grad is not None
        np.testing.assert_allclose(np.asarray(p.grad), g * (0.5 / (total + 1e-6)), rtol=1e-6)


def test_clip_leaves_small_gradients_unchanged() -> None:
    grads = [np.full(4, 0.1)]
    params = _params_with_grads(grads)
    norm = clip_grad_norm_(params, 5.0)
    assert math.isclose(float(norm), 0.2, rel_tol=1e-12)
    assert params[0].grad is not None
    np.testing.assert_array_equal(np.asarray(params[0].grad), grads[0])


def test_clip_skips_parameters_without_gradients_and_checks_max_norm() -> None:
    p = nn.Parameter(from_numpy(np.zeros(3)))
    assert float(clip_grad_norm_([p], 1.0)) == 0.0
    with pytest.raises(OptimizerError, match="max_norm must be a finite number > 0, got 0"):
        clip_grad_norm_([p], 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_the_multi_tensor_norm_kernel_is_the_float64_norm_of_all_elements(dtype: str) -> None:
    """The clip's norm kernel on the CPU: one 2-norm over every element of a list (float64 for float64, else
    float32), whatever the shapes; empty tensors count for nothing."""
    from blutrain.tensor import as_dtype, dispatch

    dt = as_dtype(dtype)
    rng = np.random.default_rng(2)
    arrays = [rng.normal(size=s).astype(dt.np) for s in ((3, 4), (0,), (5,), (2, 2, 2))]
    want = np.sqrt(sum((a.astype(np.float64) ** 2).sum() for a in arrays))
    got = dispatch.kernel("norm_multi_tensor", "cpu", dt)(arrays)
    assert got.shape == () and got.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert math.isclose(float(got), want, rel_tol=1e-7)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 7), st.sampled_from(["float32", "float64"])), min_size=1,
                max_size=6), st.floats(0.1, 4.0))
def test_global_norm_and_scale_are_the_float64_norm_and_product_of_all_elements(shapes: list[tuple[int, int, str]],
                                                                                 factor: float) -> None:
    """The helpers clip_grad_norm_ is made of, which parallel modes use on their own shards: the L2 norm of all
    elements of tensors of several shapes and dtypes together (in the widest dtype), and every tensor scaled in
    place by a 0-d device value."""
    rng = np.random.default_rng(len(shapes))
    arrays = [rng.standard_normal((r, c)).astype(d) for r, c, d in shapes]
    tensors = [from_numpy(a.copy()) for a in arrays]
    expected = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays))
    total = global_norm(tensors)
    assert total.dtype.name == ("float64" if any(d == "float64" for _, _, d in shapes) else "float32")
    assert float(total.item()) == pytest.approx(expected, rel=1e-5)
    scale_(tensors, from_numpy(np.array(factor, dtype=np.float64)))
    for a, t in zip(arrays, tensors, strict=True):
        np.testing.assert_allclose(t.numpy(), a.astype(np.float64) * factor, rtol=1e-6)


def test_global_norm_of_nothing_is_refused_in_one_line() -> None:
    with pytest.raises(OptimizerError, match="global_norm: got no tensors; give at least one"):
        global_norm([])
