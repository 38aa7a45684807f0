"""Hook specification owned by blutrain-compiler: compiler passes and codegen targets."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from blutrain.compiler.registry import PassRegistry

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_register_passes(registry: PassRegistry) -> None:
    """Add compiler passes and codegen targets by name with ``registry.register(name, pass_)``.

    Called once, when the compiler first builds its pipeline; every implementation is called.
    """
