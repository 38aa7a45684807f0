"""The ops of Llama-style blocks against their formulas in float64: rope (q and k in one kernel, the
rotate-half layout), swiglu, and rms_norm's residual operand (the residual add before the norm)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor.cpu import nn as cpu_nn
from blutrain.tensor.errors import ShapeError, TensorTypeError


def _rotate_half_reference(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face's apply_rotary_pos_emb written out: x·cos + rotate_half(x)·sin, per head (float64)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    freqs = np.outer(positions, inv)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, D)
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(1, 9), st.integers(1, 3), st.integers(1, 3), st.sampled_from((2, 8, 64)),
       st.integers(0, 2**16))
def test_rope_is_the_rotate_half_formula_for_q_and_k(B: int, T: int, kv: int, groups: int, D: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, T, kv * groups, D)), rng.standard_normal((B, T, kv, D))
    positions = np.arange(T) + 5
    angles = np.outer(positions, 1.0 / 500.0 ** (np.arange(0, D, 2) / D))
    qo, ko = bt.rope(bt.tensor(q), bt.tensor(k), bt.tensor(np.cos(angles)), bt.tensor(np.sin(angles)))
    np.testing.assert_allclose(qo.numpy(), _rotate_half_reference(q, positions, 500.0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ko.numpy(), _rotate_half_reference(k, positions, 500.0), rtol=1e-12, atol=1e-12)


def test_rope_keeps_each_heads_norm_and_its_backward_rotates_back() -> None:
    rng = np.random.default_rng(0)
    q = bt.tensor(rng.standard_normal((1, 4, 2, 6)), requires_grad=True)
    k = bt.tensor(rng.standard_normal((1, 4, 1, 6)), requires_grad=True)
    angles = rng.uniform(-3, 3, (4, 3))
    cos, sin = bt.tensor(np.cos(angles)), bt.tensor(np.sin(angles))
    qo, _ = bt.rope(q, k, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(qo.detach().numpy(), axis=-1), np.linalg.norm(q.detach().numpy(),
                                                                                              axis=-1), rtol=1e-12)
    qo.backward(qo.detach())  # d/dq ½|R q|² = Rᵀ R q = q
    np.testing.assert_allclose(q.grad.numpy(), q.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert k.grad is not None and not np.any(k.grad.numpy())  # k's output took no part in the loss


def test_rope_refuses_mismatched_shapes_and_angle_dtypes() -> None:
    q, k = bt.zeros(1, 4, 2, 6), bt.zeros(1, 4, 1, 6)
    with pytest.raises(ShapeError, match=r"rope: cos must be a \(T, D/2\) = \[4, 3\] tensor"):
        bt.rope(q, k, bt.zeros(4, 6), bt.zeros(4, 3))
    with pytest.raises(ShapeError, match=r"q must be \(B, T, H, D\) and k \(B, T, H_kv, D\) with D even"):
        bt.rope(bt.zeros(1, 4, 2, 5), bt.zeros(1, 4, 1, 5), bt.zeros(4, 2), bt.zeros(4, 2))
    with pytest.raises(TensorTypeError, match="rope: sin must have q's dtype float32"):
        bt.rope(q, k, bt.zeros(4, 3), bt.zeros(4, 3, dtype="float64"))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=3), st.integers(0, 2**16))
def test_swiglu_is_silu_of_gate_times_up(shape: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    g, u = np.asarray(rng.standard_normal(shape) * 3), np.asarray(rng.standard_normal(shape))
    got = bt.swiglu(bt.tensor(g), bt.tensor(u)).numpy()
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-13, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 33), st.booleans(), st.integers(0, 2**16))
def test_rms_norm_with_a_residual_normalizes_the_sum_and_returns_it(rows: int, width: int, affine: bool,
                                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, r = rng.standard_normal((rows, width)), rng.standard_normal((rows, width)) * 3
    w = rng.uniform(0.5, 2, width) if affine else None
    y, rstd, s = cpu_nn.rms_norm(x, w, 1e-6, 1, residual=r)
    total = r + x
    want = total / np.sqrt((total * total).mean(-1, keepdims=True) + 1e-6) * (1 if w is None else w)
    np.testing.assert_array_equal(s, total)
    np.testing.assert_allclose(y, want, rtol=1e-13)
    np.testing.assert_allclose(rstd, 1 / np.sqrt((total * total).mean(-1) + 1e-6), rtol=1e-13)


def test_rms_norm_refuses_a_residual_narrower_than_its_input() -> None:
    with pytest.raises(TensorTypeError, match="residual must be a floating dtype at least as wide as x's float32"):
        cpu_nn.rms_norm(np.zeros((2, 3), np.float32), None, 1e-6, 1, residual=np.zeros((2, 3), np.float16))
