"""Hook specification owned by ``blutrain.models``: model families as plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from blutrain.models.registry import ModelRegistry

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_register_models(registry: ModelRegistry) -> None:
    """Add model families by name with ``registry.register("gpt2", ModelSpec(...))``.

    A :class:`blutrain.models.ModelSpec` names the module class, its config class and presets, its
    Hugging Face mapping and its parallel plan; the trainer, ``blutrain generate``, the benchmarks and
    the parallelism modes use nothing else of the family. Called once, when the registry is first
    needed; every implementation is called, and a name registered twice is an error naming both plugins.
    """
