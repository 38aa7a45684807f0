"""The optimizer registry: name → optimizer class, filled by ``blutrain_register_optimizers``."""

from __future__ import annotations

from typing import Any

from blutrain.optim import hookspecs
from blutrain.tensor import plugins
from blutrain.tensor.errors import PluginError
from blutrain.tensor.registry import Registry

# the members of blutrain.optim.OptimizerProtocol a class must have (its instances hold param_groups)
PROTOCOL_MEMBERS = ("trainer_defaults", "step", "zero_grad", "state_dict", "load_state_dict")


class OptimizerRegistry(Registry[type]):
    """Optimizer name → class. A class that lacks a member of :class:`blutrain.optim.OptimizerProtocol` is refused
    when it registers (subclassing :class:`blutrain.optim.Optimizer` gives every one)."""

    def __init__(self) -> None:
        super().__init__("optimizer", {"adamw": "blutrain-optim-adamw", "sgd": "blutrain-optim-sgd"})

    def register(self, name: str, obj: type) -> None:
        missing = [m for m in PROTOCOL_MEMBERS if not hasattr(obj, m)]
        if missing:
            raise PluginError(f"{self.current_provider.plugin}: optimizer {name!r} ({getattr(obj, '__name__', obj)}) "
                              f"lacks {', '.join(missing)} of blutrain.optim.OptimizerProtocol")
        super().register(name, obj)


def optimizers() -> OptimizerRegistry:
    """Every installed optimizer (loads plugins on first use)."""
    return plugins.registry("blutrain_register_optimizers", OptimizerRegistry, hookspecs)


def create(name: str, params: Any, **hyperparameters: Any) -> Any:
    """Build the optimizer registered as ``name``; an unknown name lists what is installed."""
    return optimizers().get(name)(params, **hyperparameters)
