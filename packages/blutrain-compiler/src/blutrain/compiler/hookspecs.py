"""Hook specifications owned by blutrain-compiler: compiler passes, and the compile targets of devices."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from blutrain.compiler.registry import PassRegistry
    from blutrain.compiler.target import CompileTargetRegistry

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_register_passes(registry: PassRegistry) -> None:
    """Add compiler passes by name with ``registry.register(name, pass_)``.

    Called once, when the compiler first builds its pipeline; every implementation is called.
    """


@hookspec
def blutrain_register_compile_targets(registry: CompileTargetRegistry) -> None:
    """Add a device's compile target (:class:`blutrain.compiler.target.CompileTarget`: its fused-region code and
    its executor) under the device type with ``registry.register("cuda", target)``.

    Called once, when the compiler first builds a step; every implementation is called. A backend plugin
    that works without the compiler marks its implementation ``@hookimpl(optionalhook=True)``: it is then no
    error where blutrain-compiler is not installed.
    """
