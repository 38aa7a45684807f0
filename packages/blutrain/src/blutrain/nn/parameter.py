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
        self._init(data._data, data.dtype, data.device, data._storage, data._base)
        if requires_grad:
            self.requires_grad_(True)

    def _replace_data(self, new: Tensor) -> None:
        """Point this parameter at ``new``'s storage (another device or dtype), keeping its identity,
        ``requires_grad`` and hooks, so optimizers and autograd hooks holding it stay valid."""
        self._data = new._data
        self.dtype = new.dtype
        self.device = new.device
        self._storage = new._storage
        self._base = new._base

    def __repr__(self) -> str:
        return "Parameter(" + super().__repr__() + ")"


__all__ = ["Parameter"]
