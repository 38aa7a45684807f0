"""Whole models built from tensor ops only: a 2-layer MLP and a causal transformer block.

Each model runs in float32 and in float64 from the same (float32-exact) parameters. The float32
forward must match an independent NumPy float64 implementation, every float32 gradient must match
the float64 gradient to 1e-5 (norm-wise), and the float64 gradients must agree with central
differences of the float64 loss along random directions in parameter space.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.tensor import Tensor

Params = dict[str, np.ndarray]
rng = np.random.default_rng(2024)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def f32_exact(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


def to_tensors(params: Params, dtype: bt.DType, requires_grad: bool) -> dict[str, Tensor]:
    return {k: bt.tensor(v, dtype=dtype, requires_grad=requires_grad) for k, v in params.items()}


def gradients(loss_fn: Callable[[dict[str, Tensor]], Tensor], params: Params, dtype: bt.DType
              ) -> tuple[float, dict[str, np.ndarray]]:
    ts = to_tensors(params, dtype, True)
    loss = loss_fn(ts)
    loss.backward()
    return float(loss.item()), {k: t.grad.numpy().astype(np.float64) for k, t in ts.items()}  # type: ignore[union-attr]


def check_directional_derivatives(loss_fn: Callable[[dict[str, Tensor]], Tensor], params: Params,
                                  grads: dict[str, np.ndarray], directions: int = 3) -> None:
    def loss_at(shift: dict[str, np.ndarray], h: float) -> float:
        with no_grad():
            moved = {k: v + h * shift[k] for k, v in params.items()}
            return float(loss_fn(to_tensors(moved, bt.float64, False)).item())

    for _ in range(directions):
        v = {k: rng.standard_normal(p.shape) for k, p in params.items()}
        analytic = sum(float((grads[k] * v[k]).sum()) for k in params)
        h = 1e-5
        numeric = (loss_at(v, h) - loss_at(v, -h)) / (2 * h)
        assert abs(analytic - numeric) <= 1e-6 * max(abs(numeric), 1.0), (analytic, numeric)


# -- a 2-layer MLP ---------------------------------------------------------------------------------
N, D_IN, HIDDEN, CLASSES = 16, 7, 13, 5
MLP_X = f32_exact(rng.standard_normal((N, D_IN)))
MLP_Y = rng.integers(0, CLASSES, size=N)
MLP_PARAMS: Params = {
    "w1": f32_exact(rng.standard_normal((HIDDEN, D_IN)) / math.sqrt(D_IN)),
    "b1": f32_exact(rng.standard_normal(HIDDEN) * 0.1),
    "w2": f32_exact(rng.standard_normal((CLASSES, HIDDEN)) / math.sqrt(HIDDEN)),
    "b2": f32_exact(rng.standard_normal(CLASSES) * 0.1),
}


def mlp_logits(p: dict[str, Tensor]) -> Tensor:
    x = bt.tensor(MLP_X, dtype=p["w1"].dtype)
    return bt.linear(bt.tanh(bt.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])


def mlp_loss(p: dict[str, Tensor]) -> Tensor:
    return bt.cross_entropy(mlp_logits(p), bt.tensor(MLP_Y))


def mlp_reference(p: Params) -> tuple[np.ndarray, float]:
    h = np.tanh(MLP_X @ p["w1"].T + p["b1"])
    logits = h @ p["w2"].T + p["b2"]
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return logits, float(-logp[np.arange(N), MLP_Y].mean())


def test_mlp_forward_in_float32_matches_numpy_float64() -> None:
    want_logits, want_loss = mlp_reference(MLP_PARAMS)
    ts = to_tensors(MLP_PARAMS, bt.float32, False)
    assert rel_err(mlp_logits(ts).numpy().astype(np.float64), want_logits) < 1e-5
    assert abs(float(mlp_loss(ts).item()) - want_loss) < 1e-5 * abs(want_loss)


def test_mlp_gradients_in_float32_match_float64_for_every_parameter() -> None:
    _, g32 = gradients(mlp_loss, MLP_PARAMS, bt.float32)
    _, g64 = gradients(mlp_loss, MLP_PARAMS, bt.float64)
    for name in MLP_PARAMS:
        assert rel_err(g32[name], g64[name]) < 1e-5, name


def test_mlp_float64_gradients_match_finite_differences() -> None:
    _, g64 = gradients(mlp_loss, MLP_PARAMS, bt.float64)
    check_directional_derivatives(mlp_loss, MLP_PARAMS, g64)


# -- a causal transformer block ------------------------------------------------------------------------
B, T, C, H, V = 2, 5, 8, 2, 11
TOKENS = rng.integers(0, V, size=(B, T))
TARGETS = rng.integers(0, V, size=(B, T))
GPT_PARAMS: Params = {
    "wte": f32_exact(rng.standard_normal((V, C)) * 0.5),
    "wpe": f32_exact(rng.standard_normal((T, C)) * 0.5),
    "ln1_w": f32_exact(1 + 0.1 * rng.standard_normal(C)),
    "ln1_b": f32_exact(0.1 * rng.standard_normal(C)),
    "w_qkv": f32_exact(rng.standard_normal((3 * C, C)) / math.sqrt(C)),
    "b_qkv": f32_exact(0.1 * rng.standard_normal(3 * C)),
    "w_proj": f32_exact(rng.standard_normal((C, C)) / math.sqrt(C)),
    "b_proj": f32_exact(0.1 * rng.standard_normal(C)),
    "ln2_w": f32_exact(1 + 0.1 * rng.standard_normal(C)),
    "ln2_b": f32_exact(0.1 * rng.standard_normal(C)),
    "w_fc": f32_exact(rng.standard_normal((4 * C, C)) / math.sqrt(C)),
    "b_fc": f32_exact(0.1 * rng.standard_normal(4 * C)),
    "w_out": f32_exact(rng.standard_normal((C, 4 * C)) / math.sqrt(4 * C)),
    "b_out": f32_exact(0.1 * rng.standard_normal(C)),
    "lnf_w": f32_exact(1 + 0.1 * rng.standard_normal(C)),
    "lnf_b": f32_exact(0.1 * rng.standard_normal(C)),
}


def gpt_logits(p: dict[str, Tensor]) -> Tensor:
    idx = bt.tensor(TOKENS)
    x = bt.embedding(idx, p["wte"]) + p["wpe"][:T]
    h = bt.layer_norm(x, C, p["ln1_w"], p["ln1_b"])
    q, k, v = bt.linear(h, p["w_qkv"], p["b_qkv"]).split(C, dim=-1)
    heads = [t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v)]
    att = bt.scaled_dot_product_attention(*heads, is_causal=True)
    x = x + bt.linear(att.transpose(1, 2).reshape(B, T, C), p["w_proj"], p["b_proj"])
    h = bt.layer_norm(x, C, p["ln2_w"], p["ln2_b"])
    x = x + bt.linear(bt.gelu(bt.linear(h, p["w_fc"], p["b_fc"]), approximate="tanh"), p["w_out"], p["b_out"])
    x = bt.layer_norm(x, C, p["lnf_w"], p["lnf_b"])
    return bt.linear(x, p["wte"])  # tied output embedding: wte gets gradients from both ends


def gpt_loss(p: dict[str, Tensor]) -> Tensor:
    return bt.cross_entropy(gpt_logits(p).reshape(B * T, V), bt.tensor(TARGETS.reshape(-1)))


def _np_layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def gpt_reference(p: Params) -> tuple[np.ndarray, float]:
    x = p["wte"][TOKENS] + p["wpe"][:T]
    h = _np_layer_norm(x, p["ln1_w"], p["ln1_b"])
    qkv = h @ p["w_qkv"].T + p["b_qkv"]
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // H)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    prob = np.exp(scores - scores.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    att = (prob @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    x = x + att @ p["w_proj"].T + p["b_proj"]
    h = _np_layer_norm(x, p["ln2_w"], p["ln2_b"])
    f = h @ p["w_fc"].T + p["b_fc"]
    f = 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f**3)))
    x = x + f @ p["w_out"].T + p["b_out"]
    logits = _np_layer_norm(x, p["lnf_w"], p["lnf_b"]) @ p["wte"].T
    flat = logits.reshape(B * T, V)
    z = flat - flat.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return logits, float(-logp[np.arange(B * T), TARGETS.reshape(-1)].mean())


def test_transformer_block_forward_in_float32_matches_numpy_float64() -> None:
    want_logits, want_loss = gpt_reference(GPT_PARAMS)
    ts = to_tensors(GPT_PARAMS, bt.float32, False)
    assert rel_err(gpt_logits(ts).numpy().astype(np.float64), want_logits) < 1e-5
    assert abs(float(gpt_loss(ts).item()) - want_loss) < 1e-5 * abs(want_loss)


def test_transformer_block_gradients_in_float32_match_float64_for_every_parameter() -> None:
    loss32, g32 = gradients(gpt_loss, GPT_PARAMS, bt.float32)
    loss64, g64 = gradients(gpt_loss, GPT_PARAMS, bt.float64)
    assert abs(loss32 - loss64) < 1e-5 * abs(loss64)
    assert set(g32) == set(GPT_PARAMS)
    for name in GPT_PARAMS:
        assert np.abs(g64[name]).max() > 0, f"{name} got no gradient"
        assert rel_err(g32[name], g64[name]) < 1e-5, name


def test_transformer_block_float64_gradients_match_finite_differences() -> None:
    _, g64 = gradients(gpt_loss, GPT_PARAMS, bt.float64)
    check_directional_derivatives(gpt_loss, GPT_PARAMS, g64)
