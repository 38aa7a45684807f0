"""What the op functions know of a tensor without importing the Tensor class.

``tensor.py`` imports the op modules (``blutrain.tensor.ops``) for Tensor's methods, so the op modules never
import ``tensor.py``: they test ``isinstance(x, TensorBase)`` (``Tensor`` is its one subclass) and make each
result with the ``_make`` of one of their input tensors, the one method the host class must provide. Only the
factories (``blutrain.tensor.ops.factory``), which have no input tensor, import ``tensor.py``, and ``tensor.py``
does not import them.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any

import numpy as np

from blutrain.tensor.errors import TensorTypeError, TensorValueError

if TYPE_CHECKING:
    from blutrain.tensor.device import Device
    from blutrain.tensor.dtype import DType
    from blutrain.tensor.tensor import Tensor

Scalar = bool | int | float


class TensorBase:
    """The root of :class:`~blutrain.tensor.tensor.Tensor` (see the module doc)."""

    __slots__ = ()

    if TYPE_CHECKING:  # what the op modules read of a value they only know passed isinstance(value, TensorBase)
        array: Any
        _rg: bool
        dtype: DType
        device: Device

        @property
        def ndim(self) -> int: ...

        def item(self) -> Scalar: ...

    @staticmethod
    def _make(array: Any, dtype: DType, device: Device) -> Tensor:
        """Wrap a fresh backend array (a kernel's output) in a Tensor with its own storage."""
        raise NotImplementedError("need _make")


def _normalize_dim(dim: int, ndim: int, argument: str = "dim") -> int:
    n = builtins.max(ndim, 1)
    if not -n <= dim < n:
        raise TensorValueError(f"{argument}: expected a dimension in [{-n}, {n - 1}], got {dim}")
    return dim % n if ndim else 0


def _shape_arg(shape: tuple[Any, ...], argument: str = "size") -> tuple[int, ...]:
    """Accept ``f(2, 3)`` and ``f((2, 3))`` as PyTorch does."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    out = []
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TensorTypeError(f"{argument}: expected a sequence of ints, got {shape!r}")
        out.append(int(s))
    return tuple(out)
