"""The Llama family against an independent NumPy float64 forward (Hugging Face's names and rotary layout):
logits in float64 and float32, gradients against finite differences of the reference; grouped-query
attention against repeated K/V; training lowers the loss; registration and config errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models import ModelError, model_spec
from blutrain_model_llama import Llama, LlamaConfig, causal_gqa_attention


def config_of(cfg: dict[str, Any], **changes: Any) -> LlamaConfig:
    return LlamaConfig(block_size=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
                       n_layer=cfg["num_hidden_layers"], n_head=cfg["num_attention_heads"],
                       n_kv_head=cfg["num_key_value_heads"], n_embd=cfg["hidden_size"],
                       ffn_hidden=cfg["intermediate_size"], rope_theta=cfg["rope_theta"], norm_eps=cfg["rms_norm_eps"],
                       tie_embeddings=cfg["tie_word_embeddings"], **changes)


def model_with(cfg: dict[str, Any], w: dict[str, np.ndarray], dtype: str) -> Llama:
    model = Llama(config_of(cfg)).to(dtype=dtype)
    model.load_state_dict({k: bt.tensor(v, dtype=dtype) for k, v in w.items()})
    return model


def test_the_plugin_registers_llama() -> None:
    spec = model_spec("llama")
    assert spec.model_class is Llama and spec.hf is not None and spec.hf.architecture == "LlamaForCausalLM"
    assert spec.parallel_plan is Llama.parallel_plan


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_the_float64_reference(make_hf: Any, reference: Callable[..., np.ndarray], tied: bool) -> None:
    hf_config, random_weights = make_hf
    cfg = hf_config(tie_word_embeddings=tied)
    w = random_weights(cfg)
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 11))
    want = reference(cfg, w, ids)
    got64, _ = model_with(cfg, w, "float64")(bt.tensor(ids))
    np.testing.assert_allclose(got64.detach().numpy(), want, rtol=1e-10, atol=1e-10)
    got32, _ = model_with(cfg, w, "float32")(bt.tensor(ids))
    err = np.linalg.norm(got32.detach().numpy() - want) / np.linalg.norm(want)
    assert err < 1e-5


def test_gradients_equal_finite_differences_of_the_reference(make_hf: Any,
                                                              loss_reference: Callable[..., float]) -> None:
    hf_config, random_weights = make_hf
    cfg = hf_config(num_hidden_layers=1)
    w = random_weights(cfg, seed=3)
    rng = np.random.default_rng(2)
    ids, targets = rng.integers(0, 64, (2, 7)), rng.integers(0, 64, (2, 7))
    model = model_with(cfg, w, "float64")
    _, loss = model(bt.tensor(ids), bt.tensor(targets))
    assert loss is not None
    np.testing.assert_allclose(loss.item(), loss_reference(cfg, w, ids, targets), rtol=1e-12)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(w)
    h = 1e-6
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight",
                 "model.embed_tokens.weight"):
        for flat in rng.choice(w[name].size, 3, replace=False):
            at = np.unravel_index(flat, w[name].shape)
            plus, minus = {**w, name: w[name].copy()}, {**w, name: w[name].copy()}
            plus[name][at] += h
            minus[name][at] -= h
            fd = (loss_reference(cfg, plus, ids, targets) - loss_reference(cfg, minus, ids, targets)) / (2 * h)
            np.testing.assert_allclose(grads[name][at], fd, rtol=1e-5, atol=1e-8, err_msg=f"{name}{at}")


def test_grouped_query_attention_equals_attention_over_repeated_heads() -> None:
    rng = np.random.default_rng(4)
    q = bt.tensor(rng.standard_normal((2, 6, 5, 4)), requires_grad=True)
    k = bt.tensor(rng.standard_normal((2, 2, 5, 4)), requires_grad=True)
    v = bt.tensor(rng.standard_normal((2, 2, 5, 4)), requires_grad=True)
    got = causal_gqa_attention(q, k, v)
    rk = bt.tensor(np.repeat(k.detach().numpy(), 3, axis=1), requires_grad=True)
    rv = bt.tensor(np.repeat(v.detach().numpy(), 3, axis=1), requires_grad=True)
    want = bt.scaled_dot_product_attention(q.detach(), rk, rv, is_causal=True)
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-12, atol=1e-12)
    seed = bt.tensor(rng.standard_normal(got.shape))
    got.backward(seed)
    want.backward(seed)
    np.testing.assert_allclose(k.grad.numpy(), rk.grad.numpy().reshape(2, 2, 3, 5, 4).sum(2), rtol=1e-10)
    np.testing.assert_allclose(v.grad.numpy(), rv.grad.numpy().reshape(2, 2, 3, 5, 4).sum(2), rtol=1e-10)


def test_the_tiny_preset_learns_a_repeated_sequence() -> None:
    from blutrain.optim import create

    bt.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_layer=2, n_embd=64, ffn_hidden=128))
    opt = create("adamw", model.parameters(), lr=3e-3)
    idx = bt.tensor(np.tile(np.arange(16), (4, 2))[:, :-1])
    targets = bt.tensor(np.tile(np.arange(16), (4, 2))[:, 1:])
    losses = []
    for _ in range(30):
        _, loss = model(idx, targets, return_logits=False)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_presets_have_the_documented_shapes() -> None:
    one_b = LlamaConfig.preset("llama-1b")
    assert (one_b.n_layer, one_b.n_embd, one_b.n_head, one_b.n_kv_head, one_b.ffn_hidden, one_b.vocab_size,
            one_b.block_size) == (22, 2048, 32, 4, 5632, 32000, 2048)
    assert LlamaConfig.preset("llama-8b").n_kv_head == 8


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ModelError, match=r"n_head \(6\) must be a multiple of n_kv_head \(4\)"):
        LlamaConfig.preset("tiny", n_head=6, n_embd=96, n_kv_head=4)
    with pytest.raises(ModelError, match=r"an even head size"):
        LlamaConfig.preset("tiny", n_head=4, n_embd=12)
    with pytest.raises(ModelError, match="unknown preset 'llama-70b'"):
        LlamaConfig.preset("llama-70b")


def test_generate_appends_tokens_reproducibly() -> None:
    bt.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_layer=1, block_size=8))
    idx = bt.tensor([[1, 2, 3]])
    a = model.generate(idx, 10, seed=5)
    assert a.shape == (1, 13) and a.tolist() == model.generate(idx, 10, seed=5).tolist()


@pytest.mark.parametrize("prompt", [3, 7])
def test_decoding_with_the_kv_cache_gives_the_tokens_of_decoding_without(prompt: int) -> None:
    bt.manual_seed(1)
    model = Llama(LlamaConfig.preset("tiny", n_layer=2, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=48,
                                     block_size=12, vocab_size=64)).to(dtype="float64")
    idx = bt.tensor(np.random.default_rng(0).integers(0, 64, (2, prompt)))
    cached = model.generate(idx, 10, temperature=1.0, seed=3)  # past block_size: the window slides
    plain = model.generate(idx, 10, temperature=1.0, seed=3, use_cache=False)
    assert cached.tolist() == plain.tolist()


def test_the_cached_step_gives_the_full_forwards_last_logits() -> None:
    from blutrain.autograd import no_grad
    from blutrain.nn import KVCache

    bt.manual_seed(2)
    model = Llama(LlamaConfig.preset("tiny", n_layer=2, n_embd=32, n_head=4, n_kv_head=1, ffn_hidden=48,
                                     block_size=16, vocab_size=64)).to(dtype="float64")
    ids = bt.tensor(np.random.default_rng(1).integers(0, 64, (1, 9)))
    with no_grad():
        cache = KVCache(2)
        model.model.decode(ids[:, :5], cache)  # a prompt of 5, then 3 positions at once, then 1
        model.model.decode(ids[:, 5:8], cache)
        last = model.model.decode(ids[:, 8:], cache)
        want = model.hidden_states(ids)[:, -1:]
    np.testing.assert_allclose(last.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)


def test_flops_per_token_equal_a_hand_count_of_the_gemms_and_attention() -> None:
    # 2 layers, width 64 in 4 heads of 16 sharing 2 K/V heads (K/V width 32), SwiGLU hidden 96, vocabulary 100
    cfg = LlamaConfig(block_size=32, vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96)
    q = o = 2 * 64 * 64        # q_proj, o_proj: one multiply-add = 2 FLOPs
    k = v = 2 * 64 * 32        # k_proj, v_proj: 64 → 2 heads × 16
    mlp = 3 * 2 * 64 * 96      # gate, up: 64 → 96; down: 96 → 64
    attention = 2 * 2 * 32 * 64  # q·kᵀ and the weighted sum over 32 positions, every query head
    head = 2 * 64 * 100
    forward = 2 * (q + k + v + o + mlp + attention) + head
    assert Llama(cfg).flops_per_token(seq_len=32) == 3 * forward  # backward = 2 × forward
