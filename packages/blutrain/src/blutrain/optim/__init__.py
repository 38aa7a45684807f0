"""blutrain.optim: optimizers are plugins; this package holds their registry and hook spec."""

from blutrain.optim.registry import OptimizerRegistry, create, optimizers

__all__ = ["OptimizerRegistry", "create", "optimizers"]
