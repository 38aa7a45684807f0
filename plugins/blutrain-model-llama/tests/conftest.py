"""An independent Llama forward in NumPy float64, written from Hugging Face's LlamaForCausalLM (its tensor
names, its rotate-half rotary layout, its repeat_kv for grouped-query attention): the reference the model
and the Hugging Face interop are checked against. Also a tiny random checkpoint in Hugging Face layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

Weights = dict[str, np.ndarray]


def hf_config(**changes: Any) -> dict[str, Any]:
    """A small LlamaForCausalLM config.json: 2 layers, 4 query heads sharing 2 K/V heads."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "torch_dtype": "float32"}
    cfg.update(changes)
    return cfg


def random_weights(cfg: dict[str, Any], seed: int = 0) -> Weights:
    """Every tensor of a LlamaForCausalLM checkpoint, by its Hugging Face name, random float64."""
    rng = np.random.default_rng(seed)
    C, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = C // H
    w: Weights = {"model.embed_tokens.weight": rng.standard_normal((V, C)) * 0.5,
                  "model.norm.weight": 1 + 0.1 * rng.standard_normal(C)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(C)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(C)
        for name, shape in (("self_attn.q_proj", (H * D, C)), ("self_attn.k_proj", (KV * D, C)),
                            ("self_attn.v_proj", (KV * D, C)), ("self_attn.o_proj", (C, H * D)),
                            ("mlp.gate_proj", (F, C)), ("mlp.up_proj", (F, C)), ("mlp.down_proj", (C, F))):
            w[p + name + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rng.standard_normal((V, C)) / np.sqrt(C)
    return w


def reference_logits(cfg: dict[str, Any], w: Weights, ids: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's forward in float64: (B, T) ids → (B, T, vocab) logits."""
    C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D, eps, theta = C // H, cfg["rms_norm_eps"], cfg["rope_theta"]
    B, T = ids.shape

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., D // 2:], x[..., : D // 2]], axis=-1)

    inv_freq = 1.0 / theta ** (np.arange(0, D, 2) / D)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=-1)  # (T, D)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, KV, D).transpose(0, 2, 1, 3)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, KV, D).transpose(0, 2, 1, 3)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)  # repeat_kv
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + mask
        p_attn = np.exp(s - s.max(-1, keepdims=True))
        p_attn /= p_attn.sum(-1, keepdims=True)
        y = (p_attn @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        x = x + y @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return np.asarray(rms(x, w["model.norm.weight"]) @ head.T)


def reference_loss(cfg: dict[str, Any], w: Weights, ids: np.ndarray, targets: np.ndarray) -> float:
    logits = reference_logits(cfg, w, ids)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


@pytest.fixture
def reference() -> Callable[..., np.ndarray]:
    return reference_logits


@pytest.fixture
def make_hf() -> tuple[Callable[..., dict[str, Any]], Callable[..., Weights]]:
    return hf_config, random_weights


@pytest.fixture
def loss_reference() -> Callable[..., float]:
    return reference_loss
