"""The op functions behind Tensor's methods and the package's functional API, one module per family.

``tensor.py`` imports these modules for Tensor's methods; none of them imports ``tensor.py``
(:mod:`blutrain.tensor.base` says how they make tensors without it), except ``factory``, whose functions make a
tensor from no input tensor. ``factory`` is therefore not imported here: import ``blutrain.tensor.ops.factory``.
"""

from blutrain.tensor.ops import elementwise, indexing, linalg, nn, reduction, shape

__all__ = ["elementwise", "indexing", "linalg", "nn", "reduction", "shape"]
