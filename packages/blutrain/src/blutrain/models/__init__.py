"""blutrain.models: model definitions built from blutrain.nn (GPT-2 for now)."""

from blutrain.models.errors import ModelError, PretrainedError
from blutrain.models.gpt2 import GPT2, PRESETS, GPT2Config

__all__ = ["GPT2", "PRESETS", "GPT2Config", "ModelError", "PretrainedError"]
