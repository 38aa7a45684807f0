"""The ops mean what PyTorch's mean: float64 results against independent NumPy formulas.

The conformance suite (blutrain-kernels) checks every device against the float64 CPU kernels; these
tests check that those reference kernels are right in the first place.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import Tensor

rng = np.random.default_rng(7)


def t64(a: np.ndarray) -> Tensor:
    return bt.tensor(a, dtype="float64")


def close(got: Tensor, want: np.ndarray, rtol: float = 1e-12) -> None:
    np.testing.assert_allclose(got.numpy(), want, rtol=rtol, atol=1e-13)


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@settings(max_examples=15, deadline=None, database=None)
@given(shape=shapes, data=st.data())
def test_elementwise_math_matches_numpy_with_broadcasting(shape: tuple[int, ...], data: st.DataObject) -> None:
    other = tuple(1 if data.draw(st.booleans()) else s for s in shape)
    a, b = rng.standard_normal(shape), rng.uniform(0.5, 2, other)
    x, y = t64(a), t64(b)
    close(x + y, a + b)
    close(x - y, a - b)
    close(x * y, a * b)
    close(x / y, a / b)
    close(y**x, b**a)
    close(x // y, a // b)
    close(x % y, a % b)
    close(bt.maximum(x, y), np.maximum(a, b))
    close(bt.exp(x), np.exp(a))
    close(bt.log(y), np.log(b))
    close(bt.sigmoid(x), 1 / (1 + np.exp(-a)))
    close(bt.silu(x), a / (1 + np.exp(-a)))
    close(bt.rsqrt(y), 1 / np.sqrt(b))
    close(bt.erf(x), np.vectorize(math.erf)(a))
    close(bt.gelu(x), 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2))))
    close(bt.gelu(x, approximate="tanh"), 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))))
    close(bt.clamp(x, -0.5, 0.5), np.clip(a, -0.5, 0.5))
    close(bt.where(x > 0, x, y), np.where(a > 0, a, b))


def test_sigmoid_does_not_overflow_for_large_inputs() -> None:
    assert bt.sigmoid(t64(np.array([-1000.0, 1000.0]))).tolist() == [0.0, 1.0]


@settings(max_examples=15, deadline=None, database=None)
@given(shape=shapes, data=st.data())
def test_reductions_match_numpy(shape: tuple[int, ...], data: st.DataObject) -> None:
    a = rng.standard_normal(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    keep = data.draw(st.booleans())
    x = t64(a)
    close(x.sum(dim, keepdim=keep), a.sum(dim, keepdims=keep))
    close(x.mean(dim, keepdim=keep), a.mean(dim, keepdims=keep))
    close(x.var(dim, keepdim=keep, correction=0), a.var(dim, keepdims=keep))
    if shape[dim] > 1:
        close(x.std(dim), a.std(dim, ddof=1))
    close(x.norm(2, dim), np.linalg.norm(a, axis=dim))
    close(x.norm(1, dim), np.abs(a).sum(dim))
    close(x.norm(float("inf"), dim), np.abs(a).max(dim))
    close(x.norm(3, dim), (np.abs(a) ** 3).sum(dim) ** (1 / 3))
    close(x.logsumexp(dim), np.log(np.exp(a).sum(dim)))
    close(bt.softmax(x, dim), np.exp(a) / np.exp(a).sum(dim, keepdims=True))
    close(bt.log_softmax(x, dim), a - np.log(np.exp(a).sum(dim, keepdims=True)))
    values, indices = x.max(dim, keepdim=keep)
    close(values, a.max(dim, keepdims=keep))
    np.testing.assert_array_equal(indices.numpy(), a.argmax(dim, keepdims=keep))
    np.testing.assert_array_equal(x.argmin(dim).numpy(), a.argmin(dim))
    close(x.amax((0, dim) if dim else 0), a.max(axis=(0, dim) if dim else 0))


def test_sum_of_integers_and_bools_accumulates_in_int64() -> None:
    assert bt.ones(300, dtype="uint8").sum().item() == 300
    assert bt.ones(3, dtype="bool").sum().dtype is bt.int64


def test_logsumexp_is_stable_for_large_and_minus_infinite_inputs() -> None:
    x = t64(np.array([[1000.0, 1000.0], [-np.inf, -np.inf]]))
    out = x.logsumexp(1).numpy()
    assert out[0] == pytest.approx(1000 + math.log(2))
    assert out[1] == -np.inf


@settings(max_examples=15, deadline=None, database=None)
@given(batch=st.lists(st.integers(1, 3), max_size=2).map(tuple), m=st.integers(1, 4), k=st.integers(1, 4),
       n=st.integers(1, 4))
def test_matmul_and_linear_match_numpy(batch: tuple[int, ...], m: int, k: int, n: int) -> None:
    a, b = rng.standard_normal((*batch, m, k)), rng.standard_normal((k, n))
    close(bt.matmul(t64(a), t64(b)), a @ b)
    close(bt.matmul(t64(a[..., 0, :]), t64(b)), a[..., 0, :] @ b)
    w, bias = rng.standard_normal((n, k)), rng.standard_normal(n)
    close(bt.linear(t64(a), t64(w), t64(bias)), a @ w.T + bias)


def test_layer_norm_and_rms_norm_match_their_formulas() -> None:
    x, w, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    rows = x.reshape(3, 20)
    mean, var = rows.mean(1, keepdims=True), rows.var(1, keepdims=True)
    want = ((rows - mean) / np.sqrt(var + 1e-5)).reshape(3, 4, 5) * w + b
    close(bt.layer_norm(t64(x), (4, 5), t64(w), t64(b)), want)
    rms = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w[0]
    close(bt.rms_norm(t64(x), 5, t64(w[0]), eps=1e-6), rms)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_is_gelu_of_input_plus_bias_over_the_last_dim(approximate: str) -> None:
    x, b = rng.standard_normal((2, 3, 5)), rng.standard_normal(5)
    a = x + b
    if approximate == "tanh":
        want = 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    else:
        want = 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
    close(bt.bias_gelu(t64(x), t64(b), approximate), want)


def test_bias_gelu_rejects_a_bias_that_is_not_over_the_last_dim() -> None:
    with pytest.raises(bt.ShapeError, match=r"bias_gelu: bias must have shape \[5\], got \[3\]"):
        bt.bias_gelu(t64(np.zeros((3, 5))), t64(np.zeros(3)))
    with pytest.raises(bt.TensorValueError, match="bias_gelu: approximate must be 'none' or 'tanh', got 'fast'"):
        bt.bias_gelu(t64(np.zeros((3, 5))), t64(np.zeros(5)), "fast")


def test_cross_entropy_matches_the_formula_with_ignore_index_and_label_smoothing() -> None:
    logits, target = rng.standard_normal((6, 4)), np.array([0, 3, -100, 1, 2, -100])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    valid = target != -100
    eps = 0.1
    per_row = -(1 - eps) * logp[np.arange(6), np.where(valid, target, 0)] - eps * logp.mean(1)
    got = bt.cross_entropy(t64(logits), bt.tensor(target), label_smoothing=eps, reduction="none")
    close(got, np.where(valid, per_row, 0.0))
    mean = bt.cross_entropy(t64(logits), bt.tensor(target), label_smoothing=eps)
    assert mean.item() == pytest.approx(per_row[valid].mean(), rel=1e-12)


def test_cross_entropy_accepts_class_dim_second_with_extra_dims() -> None:
    logits, target = rng.standard_normal((2, 3, 5)), rng.integers(0, 3, (2, 5))
    flat = bt.cross_entropy(t64(logits.transpose(0, 2, 1).reshape(10, 3)), bt.tensor(target.reshape(10)),
                            reduction="none")
    close(bt.cross_entropy(t64(logits), bt.tensor(target), reduction="none"), flat.numpy().reshape(2, 5))


@pytest.mark.parametrize("kind", ["none", "causal", "bool mask", "float mask"])
def test_scaled_dot_product_attention_matches_softmax_of_scores(kind: str) -> None:
    q, k, v = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 3, 6, 8)), rng.standard_normal((2, 3, 6, 5))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(8)
    mask = None
    if kind == "causal":
        scores = np.where(np.tril(np.ones((4, 6), bool)), scores, -np.inf)
    elif kind == "bool mask":
        allowed = rng.random((4, 6)) < 0.5
        allowed[:, 0] = True
        scores, mask = np.where(allowed, scores, -np.inf), bt.tensor(allowed)
    elif kind == "float mask":
        bias = rng.standard_normal((4, 6))
        scores, mask = scores + bias, t64(bias)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    got = bt.scaled_dot_product_attention(t64(q), t64(k), t64(v), attn_mask=mask, is_causal=kind == "causal")
    close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_is_attention_per_head_of_the_packed_projection(causal: bool) -> None:
    B, T, H, D = 2, 5, 3, 4
    qkv = rng.standard_normal((B, T, 3 * H * D))
    q, k, v = (qkv[:, :, i * H * D:(i + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) * 0.7
    if causal:
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
    close(bt.self_attention(t64(qkv), H, is_causal=causal, scale=0.7), want)


def test_self_attention_scales_by_the_inverse_square_root_of_the_head_dim_by_default() -> None:
    qkv = t64(rng.standard_normal((1, 4, 3 * 2 * 9)))
    close(bt.self_attention(qkv, 2), bt.self_attention(qkv, 2, scale=1 / 3).numpy())


def test_self_attention_gradient_is_one_buffer_in_the_input_dtype() -> None:
    qkv = bt.tensor(rng.standard_normal((2, 3, 12)), dtype=bt.float32).requires_grad_()
    bt.self_attention(qkv, 2, is_causal=True).sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == (2, 3, 12) and qkv.grad.dtype is bt.float32


def test_self_attention_rejects_a_width_that_is_not_three_heads_wide() -> None:
    with pytest.raises(bt.ShapeError, match=r"self_attention: qkv must be \(B, T, 3·C\) with C a multiple of "
                                            r"n_head \(2\), got \[1, 4, 9\]"):
        bt.self_attention(t64(np.zeros((1, 4, 9))), 2)
    with pytest.raises(bt.ShapeError, match=r"got \[4, 12\]"):
        bt.self_attention(t64(np.zeros((4, 12))), 2)
    with pytest.raises(bt.TensorValueError, match="self_attention: n_head must be a positive int, got 0"):
        bt.self_attention(t64(np.zeros((1, 4, 12))), 0)
    with pytest.raises(bt.TensorTypeError, match="self_attention: qkv must be floating, got dtype int64"):
        bt.self_attention(bt.tensor(np.zeros((1, 4, 12), np.int64)), 2)


def test_indexing_matches_numpy_for_basic_and_advanced_keys() -> None:
    a = rng.standard_normal((4, 5, 6))
    x = t64(a)
    idx, mask = np.array([3, 0, -1, 0]), a[:, 0, 0] > 0
    for key in [(1,), (slice(None), 2), (Ellipsis, -1), (None, 0, slice(1, None, 2)), (idx,),
                (slice(None), idx[:2], 0), (mask,), (a > 0,)]:
        tkey = tuple(bt.tensor(k) if isinstance(k, np.ndarray) else k for k in key)
        np.testing.assert_array_equal(x[tkey].numpy(), a[key])


def test_setitem_writes_like_numpy() -> None:
    a = rng.standard_normal((4, 5))
    x = t64(a)
    x[1] = 0.0
    x[:, ::2] = t64(np.ones(3))
    x[x > 1.5] = 9.0
    a[1] = 0.0
    a[:, ::2] = 1.0
    a[a > 1.5] = 9.0
    np.testing.assert_array_equal(x.numpy(), a)


def test_gather_scatter_add_and_index_add_match_their_loops() -> None:
    x, idx = rng.standard_normal((3, 4)), rng.integers(0, 3, (2, 4))
    close(bt.gather(t64(x), 0, bt.tensor(idx)), np.take_along_axis(x, idx, 0))
    src = rng.standard_normal((2, 4))
    want = x.copy()
    for i in range(2):
        for j in range(4):
            want[idx[i, j], j] += src[i, j]
    close(bt.scatter_add(t64(x), 0, bt.tensor(idx), t64(src)), want)
    rows = np.array([2, 0, 2])
    source = rng.standard_normal((3, 4))
    want = x.copy()
    for i, r in enumerate(rows):
        want[r] += source[i]
    close(bt.index_add(t64(x), 0, bt.tensor(rows), t64(source)), want)


def test_index_put_with_accumulate_sums_repeated_indices() -> None:
    x = bt.zeros(3, dtype="float64")
    bt.index_put_(x, (bt.tensor([0, 0, 2]),), t64(np.array([1.0, 2.0, 5.0])), accumulate=True)
    assert x.tolist() == [3.0, 0.0, 5.0]


def test_embedding_picks_rows() -> None:
    w, idx = rng.standard_normal((7, 3)), rng.integers(0, 7, (2, 5))
    close(bt.embedding(bt.tensor(idx), t64(w)), w[idx])


def test_cat_stack_tril_triu_and_one_hot() -> None:
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((1, 3))
    close(bt.cat([t64(a), t64(b)]), np.concatenate([a, b]))
    close(bt.stack([t64(a), t64(a)], dim=1), np.stack([a, a], 1))
    close(bt.tril(t64(a), -1), np.tril(a, -1))
    close(bt.triu(t64(a), 1), np.triu(a, 1))
    np.testing.assert_array_equal(bt.one_hot(bt.tensor([2, 0]), 3).numpy(), [[0, 0, 1], [1, 0, 0]])


def test_dropout_keeps_about_one_minus_p_and_scales_what_it_keeps() -> None:
    bt.manual_seed(0)
    out = bt.dropout(bt.ones(20000, dtype="float64"), 0.25).numpy()
    assert set(np.unique(out)) == {0.0, 1 / 0.75}
    assert abs((out != 0).mean() - 0.75) < 0.02
    x = bt.ones(3)
    assert bt.dropout(x, 0.5, training=False) is x


def test_factories() -> None:
    assert bt.zeros(2, 3).shape == (2, 3) and bt.zeros((2, 3)).tolist() == [[0.0] * 3] * 2
    assert bt.ones(2, dtype="int32").tolist() == [1, 1]
    assert bt.full((2,), 7).dtype is bt.int64 and bt.full((2,), 0.5).dtype is bt.float32
    assert bt.arange(5).tolist() == [0, 1, 2, 3, 4] and bt.arange(1, 2, 0.25).tolist() == [1, 1.25, 1.5, 1.75]
    assert bt.linspace(0, 1, 5).tolist() == [0, 0.25, 0.5, 0.75, 1]
    assert bt.eye(2, 3).tolist() == [[1, 0, 0], [0, 1, 0]]
    like = bt.ones(2, 3, dtype="float16")
    for made in (bt.zeros_like(like), bt.ones_like(like), bt.empty_like(like), bt.full_like(like, 2.0),
                 bt.rand_like(like), bt.randn_like(like)):
        assert made.shape == (2, 3) and made.dtype is bt.float16
    assert bt.randint_like(bt.ones(4, dtype="int32"), 3).dtype is bt.int32
