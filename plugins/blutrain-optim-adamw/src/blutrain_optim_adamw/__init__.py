"""The "adamw" optimizer plugin: the AdamW class, its CPU multi-tensor kernel and its compiler pass, registered by
hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor import float32, float64
from blutrain.tensor.plugins import hookimpl
from blutrain_optim_adamw.adamw import KERNEL, AdamW
from blutrain_optim_adamw.kernel import adamw_multi_tensor, adamw_step_scalars

if TYPE_CHECKING:
    from blutrain.compiler import PassRegistry
    from blutrain.optim import OptimizerRegistry
    from blutrain.tensor import KernelRegistry


@hookimpl
def blutrain_register_optimizers(registry: OptimizerRegistry) -> None:
    registry.register("adamw", AdamW)


@hookimpl
def blutrain_register_kernels(registry: KernelRegistry) -> None:
    # float32 and float64 parameters; half-precision parameters want fp32 master weights, which is
    # the mixed-precision policy's job, not this kernel's.
    registry.register(KERNEL, "cpu", (float32, float64), adamw_multi_tensor)


@hookimpl
def blutrain_register_passes(registry: PassRegistry) -> None:
    # the pass module imports xDSL: loaded when the compiler first builds its pipeline, not with the plugin
    from blutrain_optim_adamw.grad_scale import AdamWGradScale

    registry.register(AdamWGradScale.name, AdamWGradScale, runs_before=AdamWGradScale.runs_before)


def __getattr__(name: str) -> object:
    if name == "AdamWGradScale":  # the compiler pass, imported on first use (it imports xDSL)
        from blutrain_optim_adamw.grad_scale import AdamWGradScale

        return AdamWGradScale
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdamW", "AdamWGradScale", "adamw_multi_tensor", "adamw_step_scalars", "blutrain_register_kernels",
           "blutrain_register_optimizers", "blutrain_register_passes"]
