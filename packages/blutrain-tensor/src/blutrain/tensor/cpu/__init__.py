"""The built-in CPU device: a NumPy backend and dtype-generic kernels.

The kernels take their array module from their inputs, so the same code is the CPU implementation,
the float64 reference of the conformance suite, and the long tail of any NumPy-compatible device
(CuPy) until a fused kernel replaces an op there. That makes them public API for backends: ``TABLE``
(op → (kernel, dtypes, whether float16/bfloat16 inputs are computed in float32)), ``STATISTICS`` (the
outputs of a forward kernel that stay float32 for half inputs), ``kernel_for`` (a kernel wrapped as the CPU
registers it), ``check_embedding_addend``, and the kernel modules by family (``elementwise``, ``indexing``,
``linalg``, ``nn``, ``reduction``), whose functions are the generic kernels of the ops they name.
"""

from blutrain.tensor.cpu import elementwise, indexing, linalg, nn, reduction
from blutrain.tensor.cpu.indexing import check_embedding_addend
from blutrain.tensor.cpu.kernels import STATISTICS, TABLE, kernel_for

__all__ = ["STATISTICS", "TABLE", "check_embedding_addend", "elementwise", "indexing", "kernel_for", "linalg", "nn",
           "reduction"]
