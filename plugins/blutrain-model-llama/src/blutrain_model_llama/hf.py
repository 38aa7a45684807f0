"""Hugging Face ``LlamaForCausalLM`` checkpoints: ``config.json`` keys ↔ :class:`LlamaConfig` fields, and the
tensors, whose names and layouts are the model's own (the rotate-half rotary layout needs no permutation).

Loading refuses what this model does not compute (another ``model_type``, an activation other than SiLU,
attention or MLP biases, rope scaling, a head size other than hidden_size / heads) with a
``PretrainedError`` naming the file and the key, and a tensor of the wrong shape for the config likewise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.models import ModelError, PretrainedError
from blutrain.models.hf import CONFIG_NAME, read_hf_config, read_hf_weights, write_hf_directory
from blutrain.nn import StateDictError
from blutrain.tensor import Tensor
from blutrain_model_llama.config import LlamaConfig

# LlamaConfig field → config.json key, and the key's default where Hugging Face has one
CONFIG_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size", "n_embd": "hidden_size", "ffn_hidden": "intermediate_size",
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "block_size": "max_position_embeddings", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# buffers some exported files carry: no weights
_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)


def config_from_hf(hf: dict[str, Any], path: Path, overrides: dict[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``LlamaForCausalLM`` config.json (with ``overrides`` applied)."""
    if hf.get("model_type", "llama") != "llama":
        raise PretrainedError(f"{path}: model_type is {hf.get('model_type')!r}; the llama family reads 'llama' "
                              "(LlamaForCausalLM)")
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise PretrainedError(f"{path}: missing Llama config key(s) {', '.join(missing)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise PretrainedError(f"{path}: hidden_act must be 'silu' (SwiGLU), got {hf['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise PretrainedError(f"{path}: {key}=true is not supported (this model has no biases)")
    if hf.get("rope_scaling") is not None:
        raise PretrainedError(f"{path}: rope_scaling {hf['rope_scaling']!r} is not supported (plain rotary "
                              "embeddings only); remove it only if the model was trained without it")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise PretrainedError(f"{path}: head_dim {head_dim} × num_attention_heads {hf['num_attention_heads']} must "
                              f"equal hidden_size {hf['hidden_size']}")
    values = {field: hf[key] for field, key in CONFIG_KEYS.items() if hf.get(key) is not None}
    values.setdefault("n_kv_head", hf["num_attention_heads"])
    try:
        return LlamaConfig(**{**values, **overrides})
    except (ModelError, TypeError) as exc:
        raise PretrainedError(f"{path}: {exc}") from None


def config_to_hf(config: LlamaConfig, dtype: str) -> dict[str, Any]:
    """The ``LlamaForCausalLM`` config.json of ``config`` (weights stored in ``dtype``)."""
    out: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                           "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
                           "head_dim": config.head_dim, "torch_dtype": dtype}
    out.update({key: getattr(config, field) for field, key in CONFIG_KEYS.items()})
    return out


def load_pretrained(cls: Any, directory: str | os.PathLike[str], **overrides: Any) -> Any:
    """A ``cls`` (:class:`~blutrain_model_llama.Llama`) with the weights of a Hugging Face directory, in
    float32 (the stored dtype is converted exactly or rounded once)."""
    root = Path(directory)
    config = config_from_hf(read_hf_config(root), root / CONFIG_NAME, overrides)
    raw = {k: t for k, t in read_hf_weights(root).items() if not k.endswith(_BUFFER_SUFFIXES)}
    head = raw.pop("lm_head.weight", None) if config.tie_embeddings else None
    model = cls(config)
    if head is not None:  # a tied checkpoint may store the head too: it must be the embedding
        emb = raw.get("model.embed_tokens.weight")
        if emb is not None and (head.shape != emb.shape or not np.array_equal(np.asarray(head), np.asarray(emb))):
            raise PretrainedError(f"{root}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
    try:
        model.load_state_dict(raw)
    except StateDictError as exc:
        raise PretrainedError(f"{root}: the weights do not fit its {CONFIG_NAME} ({exc})") from None
    return model


def save_pretrained(model: Any, directory: str | os.PathLike[str], max_shard_bytes: int | None = None) -> None:
    """Write ``model`` as a Hugging Face ``LlamaForCausalLM`` directory (a tied head is not stored), in one
    ``model.safetensors`` or, with ``max_shard_bytes``, shards and their index."""
    tensors: dict[str, Tensor] = {k: t.detach() for k, t in model.state_dict().items()}
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    dtype = next(iter(tensors.values())).dtype.name
    write_hf_directory(directory, config_to_hf(model.config, dtype), tensors, max_shard_bytes)


__all__ = ["CONFIG_KEYS", "config_from_hf", "config_to_hf", "load_pretrained", "save_pretrained"]
