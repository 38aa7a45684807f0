"""The "sgd" optimizer plugin: the SGD class and its multi-tensor kernel, registered by hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor import float32, float64
from blutrain.tensor.plugins import hookimpl
from blutrain_optim_sgd.kernel import sgd_multi_tensor
from blutrain_optim_sgd.sgd import KERNEL, SGD

if TYPE_CHECKING:
    from blutrain.optim import OptimizerRegistry
    from blutrain.tensor import KernelRegistry


@hookimpl
def blutrain_register_optimizers(registry: OptimizerRegistry) -> None:
    registry.register("sgd", SGD)


@hookimpl
def blutrain_register_kernels(registry: KernelRegistry) -> None:
    registry.register(KERNEL, "cpu", (float32, float64), sgd_multi_tensor)
    # The kernel takes the array module of its inputs, so CuPy arrays run the same code (a handful of
    # elementwise launches per parameter); a backend with a fused one registers it at a higher priority.
    registry.register(KERNEL, "cuda", (float32, float64), sgd_multi_tensor)


__all__ = ["SGD", "blutrain_register_kernels", "blutrain_register_optimizers", "sgd_multi_tensor"]
