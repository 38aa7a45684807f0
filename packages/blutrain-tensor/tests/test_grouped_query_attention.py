"""Grouped-query attention (``scaled_dot_product_attention(..., enable_gqa=True)``): key and value carry H_kv
heads shared by groups of H / H_kv query heads. Checked in float64 against attention with the key/value heads
repeated explicitly (forward) and against the analytic gradients of that repeated attention summed over each
group (backward)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import Tensor
from blutrain.tensor.errors import ShapeError


def t64(a: np.ndarray, grad: bool = False) -> Tensor:
    t = bt.tensor(a, dtype="float64")
    return t.requires_grad_() if grad else t


def repeated_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, causal: bool,
                       scale: float) -> tuple[np.ndarray, ...]:
    """Output and (dq, dk, dv) of attention with each key/value head repeated for its query group, dk and dv
    summed back over the group: the meaning of grouped-query attention, in plain NumPy."""
    group = q.shape[-3] // k.shape[-3]
    kr, vr = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = q @ np.swapaxes(kr, -1, -2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ vr
    dp = dout @ np.swapaxes(vr, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = ds @ kr * scale
    dkr, dvr = np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ dout

    def fold(d: np.ndarray) -> np.ndarray:
        folded: np.ndarray = d.reshape(*k.shape[:-3], k.shape[-3], group, *d.shape[-2:]).sum(-3)
        return folded

    return out, dq, fold(dkr), fold(dvr)


@settings(max_examples=30, deadline=None, database=None)
@given(batch=st.lists(st.integers(1, 2), max_size=2).map(tuple), kv_heads=st.integers(1, 3),
       group=st.sampled_from((1, 2, 3, 4, 8)), L=st.integers(1, 7), S=st.integers(1, 7), D=st.integers(1, 6),
       causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_grouped_query_attention_matches_attention_with_repeated_key_value_heads(
        batch: tuple[int, ...], kv_heads: int, group: int, L: int, S: int, D: int, causal: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, kv_heads * group, L, D))
    k, v = rng.standard_normal((*batch, kv_heads, S, D)), rng.standard_normal((*batch, kv_heads, S, D + 1))
    dout = rng.standard_normal((*batch, kv_heads * group, L, D + 1))
    scale = 1 / math.sqrt(D)
    want = repeated_attention(q, k, v, dout, causal, scale)
    tq, tk, tv = t64(q, True), t64(k, True), t64(v, True)
    out = bt.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    out.backward(t64(dout))
    got = [out] + [t.grad for t in (tq, tk, tv)]
    for g, w in zip(got, want, strict=True):
        assert g is not None and g.shape == w.shape
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=1e-10, atol=1e-12)


def test_grouped_query_attention_reads_transposed_views_of_the_projections() -> None:
    rng = np.random.default_rng(3)
    B, T, H, Hkv, D = 2, 5, 4, 2, 3
    q, k, v = (rng.standard_normal((B, T, h, D)) for h in (H, Hkv, Hkv))
    want = repeated_attention(np.swapaxes(q, 1, 2), np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2),
                              np.zeros((B, H, T, D)), True, 0.5)[0]
    got = bt.scaled_dot_product_attention(t64(q).transpose(1, 2), t64(k).transpose(1, 2), t64(v).transpose(1, 2),
                                          is_causal=True, scale=0.5, enable_gqa=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_grouped_query_attention_takes_a_mask_over_the_query_heads() -> None:
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 4, 3, 2)), rng.standard_normal((1, 2, 5, 2)), rng.standard_normal((1, 2, 5, 2))
    allowed = rng.random((4, 3, 5)) < 0.6
    allowed[..., 0] = True
    got = bt.scaled_dot_product_attention(t64(q), t64(k), t64(v), attn_mask=bt.tensor(allowed), enable_gqa=True)
    want = bt.scaled_dot_product_attention(t64(q), t64(np.repeat(k, 2, axis=1)), t64(np.repeat(v, 2, axis=1)),
                                           attn_mask=bt.tensor(allowed))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-13)


def test_enable_gqa_with_equal_head_counts_is_plain_attention() -> None:
    rng = np.random.default_rng(5)
    q, k, v = (t64(rng.standard_normal((2, 3, 4, 5))) for _ in range(3))
    np.testing.assert_array_equal(bt.scaled_dot_product_attention(q, k, v, enable_gqa=True).numpy(),
                                  bt.scaled_dot_product_attention(q, k, v).numpy())


@pytest.mark.parametrize(("q_shape", "k_shape", "v_shape", "gqa", "message"), [
    ((1, 4, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2), False, "pass enable_gqa=True"),
    ((1, 6, 3, 2), (1, 4, 3, 2), (1, 4, 3, 2), True, "a divisor of query's 6; got key 4 and value 4 heads"),
    ((1, 4, 3, 2), (1, 2, 3, 2), (1, 1, 3, 2), True, "got key 2 and value 1 heads"),
    ((3, 2), (3, 2), (3, 2), True, "heads at dim -3"),
    ((2, 4, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2), True, "do not fit"),
])
def test_bad_head_counts_raise_one_line_shape_errors(q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                                                      v_shape: tuple[int, ...], gqa: bool, message: str) -> None:
    q, k, v = (bt.ones(*s) for s in (q_shape, k_shape, v_shape))
    with pytest.raises(ShapeError, match=message) as info:
        bt.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    assert "\n" not in str(info.value)


def test_plain_attention_names_no_gqa_hint_when_heads_cannot_group() -> None:
    q, k = bt.ones(1, 3, 2, 2), bt.ones(1, 2, 2, 2)
    with pytest.raises(ShapeError) as info:
        bt.scaled_dot_product_attention(q, k, k)
    assert "enable_gqa" not in str(info.value)
