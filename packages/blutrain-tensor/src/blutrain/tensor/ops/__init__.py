"""The op functions behind Tensor's methods and the package's functional API, one module per family."""

from blutrain.tensor.ops import elementwise, factory, indexing, linalg, nn, reduction, shape

__all__ = ["elementwise", "factory", "indexing", "linalg", "nn", "reduction", "shape"]
