"""Hook specification owned by the ``blutrain`` facade's optim package."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from blutrain.optim.registry import OptimizerRegistry

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_register_optimizers(registry: OptimizerRegistry) -> None:
    """Add optimizer classes by name with ``registry.register("adamw", AdamW)``.

    The class is constructed as ``cls(params, **hyperparameters)`` and must implement
    :class:`blutrain.optim.OptimizerProtocol` (subclassing :class:`blutrain.optim.Optimizer` is the
    easy way). Called once, when the registry is first needed; every implementation is called.
    """
