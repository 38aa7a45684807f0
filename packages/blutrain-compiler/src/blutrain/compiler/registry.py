"""The registry of compiler passes, filled by ``blutrain_register_passes``."""

from __future__ import annotations

from typing import Any

from blutrain.compiler import hookspecs
from blutrain.tensor import plugins
from blutrain.tensor.registry import Registry


class PassRegistry(Registry[Any]):
    """Pass or codegen-target name → the pass object."""

    def __init__(self) -> None:
        super().__init__("compiler pass")


def passes() -> PassRegistry:
    plugins.add_hookspecs(hookspecs)
    return plugins.registry("blutrain_register_passes", PassRegistry)
