"""The exception hierarchy of blutrain.nn: errors a user of a module can act on."""

from __future__ import annotations

from blutrain.tensor.errors import BluTrainError


class ModuleError(BluTrainError, ValueError):
    """A module was built or used inconsistently (bad sizes, wrong kind of value for an attribute)."""


class StateDictError(ModuleError):
    """A state dict does not fit the module: missing, unexpected or mis-shaped keys, all named."""


__all__ = ["ModuleError", "StateDictError"]
