"""blutrain-kernels-example: an alternative kernel for one op, as a plugin.

It registers the "gelu" kernel on devices "cpu" and "cuda" for every floating dtype at a priority above
the built-in ones, so ``blutrain.tensor.gelu`` (and ``nn.GELU``, GPT-2's MLP) run it wherever it is
installed. Block it with ``BLUTRAIN_DISABLE_PLUGINS=kernels-example`` to get the built-in kernels back.
"""

from __future__ import annotations

from blutrain.tensor import FLOATING_DTYPES, KernelRegistry, hookimpl
from blutrain_kernels_example.gelu import gelu_cpu, gelu_cuda, gelu_tanh_numpy

OP = "gelu"
# Higher priority wins for one (op, device, dtype). The built-in cpu kernels register at 0 and the cuda
# backend's fused kernels at 10; equal priorities from two plugins are an error, so pick a free one.
PRIORITY = 20


@hookimpl
def blutrain_register_kernels(registry: KernelRegistry) -> None:
    registry.register(OP, "cpu", FLOATING_DTYPES, gelu_cpu, priority=PRIORITY)
    registry.register(OP, "cuda", FLOATING_DTYPES, gelu_cuda, priority=PRIORITY)


__all__ = ["OP", "PRIORITY", "blutrain_register_kernels", "gelu_cpu", "gelu_cuda", "gelu_tanh_numpy"]
