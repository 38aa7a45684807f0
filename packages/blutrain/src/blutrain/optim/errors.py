"""The exception hierarchy of blutrain.optim."""

from __future__ import annotations

from blutrain.tensor.errors import BluTrainError


class OptimizerError(BluTrainError, ValueError):
    """An optimizer argument, parameter group or state dict is invalid; the message names it."""


__all__ = ["OptimizerError"]
