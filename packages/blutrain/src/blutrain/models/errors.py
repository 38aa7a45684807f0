"""The exception hierarchy of blutrain.models."""

from __future__ import annotations

from blutrain.tensor.errors import BluTrainError


class ModelError(BluTrainError, ValueError):
    """A model configuration or input is invalid; the message names the field, expected and received."""


class PretrainedError(ModelError):
    """A pretrained directory (config.json + model.safetensors) is missing, malformed or unsupported."""


__all__ = ["ModelError", "PretrainedError"]
