"""Compile targets: what a device brings to a compiled step, its fused regions' code and its executor.

The compiler core knows no device library. A device's backend plugin registers a :class:`CompileTarget`
for its device type through ``blutrain_register_compile_targets``, as tinygrad's devices hand the core their
graph class: the built-in NumPy target runs a step on "cpu" (generated NumPy functions, :class:`CPUExecutor`),
and blutrain-backend-cupy's runs it on "cuda" (CUDA elementwise kernels, one captured CUDA graph in a planned
arena). :func:`compile_target` is what the compiler asks when it builds a step for a device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from blutrain.compiler import hookspecs
from blutrain.compiler.errors import CompilerError
from blutrain.tensor import plugins
from blutrain.tensor.errors import NotRegisteredError
from blutrain.tensor.registry import Registry

if TYPE_CHECKING:
    from blutrain.compiler.arena import ArenaReport
    from blutrain.compiler.dialect import FusedOp
    from blutrain.compiler.executor import Program


class Executor(Protocol):
    """Runs one compiled :class:`~blutrain.compiler.executor.Program` on its device.

    ``run`` copies ``inputs`` into the program's static inputs, runs the program once and returns copies of
    its outputs (arrays the next run does not overwrite); ``updated`` says that launches' scalar arguments
    changed since the last run (counted in ``updates``); ``close`` gives the executor's memory back at once
    (it cannot run after). ``report`` is the planned arena of the last run, None where the device plans none.
    """

    report: ArenaReport | None
    updates: int

    def run(self, inputs: list[Any]) -> list[Any]: ...

    def updated(self) -> None: ...

    def close(self) -> None: ...


class CompileTarget(Protocol):
    """A device's part of the compiler: ``device`` (its type, "cuda"), the code of a fused elementwise region
    (``compile_region(op)`` → ``fn(consts, *inputs) -> tuple`` of that device's arrays, one result per region
    result, each member computing as its eager kernel does) and the executor of a compiled program (its inputs
    and state given as that device's arrays)."""

    device: str

    def compile_region(self, op: FusedOp) -> Callable[..., Any]: ...

    def executor(self, program: Program, inputs: list[Any], state: list[Any]) -> Executor: ...


class CompileTargetRegistry(Registry[CompileTarget]):
    """Device type → its compile target."""

    def __init__(self) -> None:
        super().__init__("compile target")


def compile_targets() -> CompileTargetRegistry:
    plugins.add_hookspecs(hookspecs)
    return plugins.registry("blutrain_register_compile_targets", CompileTargetRegistry)


def compile_target(device: str) -> CompileTarget:
    """The compile target of device type ``device``, or a CompilerError naming what is installed."""
    registry = compile_targets()
    try:
        return registry.get(device)
    except NotRegisteredError:
        raise CompilerError(f"compile: no compile target for device {device!r} (installed: {registry.describe()}); "
                            "its backend plugin brings one (cuda: blutrain-backend-cupy), or run the step "
                            "uncompiled") from None


__all__ = ["CompileTarget", "CompileTargetRegistry", "Executor", "compile_target", "compile_targets"]
