"""Parameter: a Tensor that a Module registers as trainable state."""

from __future__ import annotations

from blutrain.tensor import Tensor
from blutrain.tensor.errors import TensorTypeError


class Parameter(Tensor):
    """A tensor that requires grad by default and is registered when assigned to a Module attribute.

    ``Parameter(t)`` shares ``t``'s storage (no copy), as PyTorch's does. Ops on a Parameter return
    plain Tensors; only the leaf itself is a Parameter.
    """

    __slots__ = ()

    def __init__(self, data: Tensor, requires_grad: bool = True) -> None:
        if not isinstance(data, Tensor):
            raise TensorTypeError(f"Parameter: data must be a Tensor, got {type(data).__name__}")
        super().__init__(data, copy=False, requires_grad=requires_grad)

    def __repr__(self) -> str:
        return "Parameter(" + super().__repr__() + ")"


__all__ = ["Parameter"]
