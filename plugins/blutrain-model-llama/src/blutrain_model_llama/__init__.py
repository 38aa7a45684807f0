"""The "llama" model family: a Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention, no biases, untied head) registered through ``blutrain_register_models``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.models import HFMapping, ModelSpec
from blutrain.tensor.plugins import hookimpl
from blutrain_model_llama.config import PRESETS, LlamaConfig
from blutrain_model_llama.model import (
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaMLP,
    LlamaModel,
    causal_gqa_attention,
)

if TYPE_CHECKING:
    from blutrain.models import ModelRegistry

LLAMA_SPEC = ModelSpec(
    name="llama",
    model_class=Llama,
    config_class=LlamaConfig,
    presets=PRESETS,
    hf=HFMapping(model_type="llama", architecture="LlamaForCausalLM"),
    description="Llama-style: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, untied head",
)


@hookimpl
def blutrain_register_models(registry: ModelRegistry) -> None:
    registry.register(LLAMA_SPEC.name, LLAMA_SPEC)


__all__ = ["LLAMA_SPEC", "PRESETS", "Llama", "LlamaAttention", "LlamaBlock", "LlamaConfig", "LlamaMLP", "LlamaModel",
           "blutrain_register_models", "causal_gqa_attention"]
