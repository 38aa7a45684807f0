"""The model registry: family name → :class:`ModelSpec`, filled by ``blutrain_register_models``."""

from __future__ import annotations

from blutrain.models import hookspecs
from blutrain.models.errors import ModelError
from blutrain.models.spec import ModelSpec
from blutrain.tensor import plugins
from blutrain.tensor.registry import Registry

DEFAULT_MODEL = "gpt2"


class ModelRegistry(Registry[ModelSpec]):
    def __init__(self) -> None:
        super().__init__("model")

    def register(self, name: str, obj: ModelSpec) -> None:
        """Add ``obj`` under ``name``; the spec's own name must be ``name`` (messages and checkpoints
        record the family by it)."""
        if not isinstance(obj, ModelSpec):
            raise ModelError(f"{self.current_provider.plugin}: model {name!r} must be registered as a ModelSpec, "
                             f"got {type(obj).__name__}")
        if obj.name != name:
            raise ModelError(f"{self.current_provider.plugin}: model registered as {name!r} has ModelSpec.name "
                             f"{obj.name!r}; give both the same name")
        super().register(name, obj)


def models() -> ModelRegistry:
    """Every installed model family (loads plugins on first use)."""
    return plugins.registry("blutrain_register_models", ModelRegistry, hookspecs)


def model_spec(name: str = DEFAULT_MODEL) -> ModelSpec:
    """The family registered as ``name``; an unknown name lists what is installed."""
    return models().get(name)


__all__ = ["DEFAULT_MODEL", "ModelRegistry", "model_spec", "models"]
