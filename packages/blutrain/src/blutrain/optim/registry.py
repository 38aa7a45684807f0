"""The optimizer registry: name → optimizer class, filled by ``blutrain_register_optimizers``."""

from __future__ import annotations

from typing import Any

from blutrain.optim import hookspecs
from blutrain.tensor import plugins
from blutrain.tensor.registry import Registry


class OptimizerRegistry(Registry[type]):
    def __init__(self) -> None:
        super().__init__("optimizer", {"adamw": "blutrain-optim-adamw", "sgd": "blutrain-optim-sgd"})


def optimizers() -> OptimizerRegistry:
    """Every installed optimizer (loads plugins on first use)."""
    plugins.add_hookspecs(hookspecs)
    return plugins.registry("blutrain_register_optimizers", OptimizerRegistry)


def create(name: str, params: Any, **hyperparameters: Any) -> Any:
    """Build the optimizer registered as ``name``; an unknown name lists what is installed."""
    return optimizers().get(name)(params, **hyperparameters)
