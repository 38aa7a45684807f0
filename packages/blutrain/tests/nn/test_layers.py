"""Layers against float64 NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from blutrain import nn
from blutrain import tensor as bt
from blutrain.tensor import Tensor, float64, manual_seed, randn, tensor


def a(t: Tensor) -> np.ndarray:
    return np.asarray(t.detach())


def test_linear_is_x_wt_plus_b() -> None:
    m = nn.Linear(4, 3).to(float64)
    x = randn(5, 4, dtype=float64)
    np.testing.assert_allclose(a(m(x)), a(x) @ a(m.weight).T + a(m.bias), rtol=1e-12)
    assert m.weight.shape == (3, 4) and m.bias is not None and m.bias.shape == (3,)


def test_linear_default_init_is_bounded_by_one_over_sqrt_fan_in() -> None:
    manual_seed(0)
    m = nn.Linear(64, 32)
    assert np.abs(a(m.weight)).max() <= 1 / math.sqrt(64)
    assert np.abs(a(m.weight)).max() > 0.9 / math.sqrt(64)


def test_linear_rejects_a_non_positive_size() -> None:
    with pytest.raises(nn.ModuleError, match="Linear: in_features must be a positive int, got 0"):
        nn.Linear(0, 3)


def test_embedding_picks_rows() -> None:
    m = nn.Embedding(10, 4)
    idx = tensor([[1, 9], [0, 1]])
    np.testing.assert_array_equal(a(m(idx)), a(m.weight)[np.array([[1, 9], [0, 1]])])


def test_layer_norm_matches_reference() -> None:
    m = nn.LayerNorm(6, eps=1e-5).to(float64)
    nn.init.normal_(m.weight)
    assert m.bias is not None
    nn.init.normal_(m.bias)
    x = randn(3, 6, dtype=float64)
    xn = a(x)
    xhat = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-5)
    ref = xhat * a(m.weight) + a(m.bias)
    np.testing.assert_allclose(a(m(x)), ref, rtol=1e-10, atol=1e-12)


def test_layer_norm_starts_as_ones_and_zeros() -> None:
    m = nn.LayerNorm(4)
    assert m.weight is not None and m.bias is not None
    np.testing.assert_array_equal(a(m.weight), 1.0)
    np.testing.assert_array_equal(a(m.bias), 0.0)


def test_gelu_tanh_matches_gpt2_formula() -> None:
    x = randn(100, dtype=float64)
    xn = a(x)
    ref = 0.5 * xn * (1 + np.tanh(math.sqrt(2 / math.pi) * (xn + 0.044715 * xn**3)))
    np.testing.assert_allclose(a(nn.GELU("tanh")(x)), ref, rtol=1e-12)


def test_gelu_rejects_an_unknown_approximation() -> None:
    with pytest.raises(nn.ModuleError, match="approximate must be 'none' or 'tanh', got 'fast'"):
        nn.GELU("fast")


def test_sequential_chains_and_indexes() -> None:
    first, second = nn.Linear(2, 3), nn.Linear(3, 1)
    m = nn.Sequential(first, second)
    x = randn(4, 2)
    np.testing.assert_allclose(a(m(x)), a(second(first(x))), rtol=1e-6)
    assert m[0] is first and m[-1] is second and len(m) == 2


def test_module_list_registers_indexes_and_slices() -> None:
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    assert [n for n, _ in layers.named_parameters()][:2] == ["0.weight", "0.bias"]
    assert layers[-1] is list(layers)[2]
    assert len(layers[1:]) == 2
    with pytest.raises(IndexError, match="index 3 is out of range for 3 modules"):
        layers[3]


def _attention_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, wo: np.ndarray, bo: np.ndarray,
                         n_head: int) -> np.ndarray:
    B, T, C = x.shape
    hs = C // n_head
    qkv = x @ w.T + b
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hs).transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y @ wo.T + bo


def test_causal_self_attention_matches_reference() -> None:
    m = nn.CausalSelfAttention(8, 2).to(float64)
    x = randn(2, 5, 8, dtype=float64)
    assert m.c_attn.bias is not None and m.c_proj.bias is not None
    ref = _attention_reference(a(x), a(m.c_attn.weight), a(m.c_attn.bias), a(m.c_proj.weight),
                               a(m.c_proj.bias), 2)
    np.testing.assert_allclose(a(m(x)), ref, rtol=1e-10, atol=1e-12)


def test_causal_self_attention_does_not_look_ahead() -> None:
    m = nn.CausalSelfAttention(8, 4).to(float64)
    x = randn(1, 6, 8, dtype=float64)
    changed = bt.cat([x[:, :4], randn(1, 2, 8, dtype=float64)], dim=1)
    np.testing.assert_array_equal(a(m(x))[:, :4], a(m(changed))[:, :4])


def test_causal_self_attention_checks_sizes() -> None:
    with pytest.raises(nn.ModuleError, match=r"n_embd \(10\) must be a positive multiple of n_head \(4\)"):
        nn.CausalSelfAttention(10, 4)
    with pytest.raises(ValueError, match=r"input must be \(B, T, 8\), got \[2, 8\]"):
        nn.CausalSelfAttention(8, 2)(randn(2, 8))


def test_functional_reexports_the_tensor_ops() -> None:
    assert nn.functional.cross_entropy is bt.cross_entropy
    assert nn.functional.scaled_dot_product_attention is bt.scaled_dot_product_attention
    assert set(nn.functional.__all__) >= {"linear", "gelu", "layer_norm", "dropout", "softmax", "embedding"}


def test_init_functions_fill_in_place_without_recording() -> None:
    p = nn.Parameter(randn(1000))
    assert nn.init.normal_(p, 1.0, 0.5) is p
    assert abs(a(p).mean() - 1.0) < 0.1 and abs(a(p).std() - 0.5) < 0.1
    assert p.grad_fn is None
    np.testing.assert_array_equal(a(nn.init.ones_(p)), 1.0)
    np.testing.assert_array_equal(a(nn.init.zeros_(p)), 0.0)
    u = a(nn.init.uniform_(p, -2.0, -1.0))
    assert u.min() >= -2.0 and u.max() < -1.0
