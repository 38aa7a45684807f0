"""The built-in "gpt2" model family: registered through ``blutrain_register_models`` like any other
model plugin (entry point ``gpt2`` of the ``blutrain`` distribution), so it can be blocked by name
(``BLUTRAIN_DISABLE_PLUGINS=gpt2``) or stand beside others."""

from __future__ import annotations

from blutrain.models.gpt2 import GPT2, PRESETS, GPT2Config
from blutrain.models.registry import ModelRegistry
from blutrain.models.spec import HFMapping, ModelSpec
from blutrain.tensor.plugins import hookimpl

GPT2_SPEC = ModelSpec(
    name="gpt2",
    model_class=GPT2,
    config_class=GPT2Config,
    presets=PRESETS,
    hf=HFMapping(model_type="gpt2", architecture="GPT2LMHeadModel"),
    description="GPT-2: pre-LayerNorm, learned positions, GELU-tanh MLP, tied head",
)


@hookimpl
def blutrain_register_models(registry: ModelRegistry) -> None:
    registry.register(GPT2_SPEC.name, GPT2_SPEC)


__all__ = ["GPT2_SPEC", "blutrain_register_models"]
