"""In-place initialisers; each runs under ``no_grad`` and draws from the device's default generator,
so ``blutrain.tensor.manual_seed`` makes a model's initial weights reproducible."""

from __future__ import annotations

from blutrain.autograd import no_grad
from blutrain.tensor import Tensor
from blutrain.tensor.errors import TensorValueError


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    if std < 0:
        raise TensorValueError(f"normal_: std must be >= 0, got {std}")
    with no_grad():
        return tensor.normal_(mean, std)


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    if b < a:
        raise TensorValueError(f"uniform_: expected a <= b, got a={a}, b={b}")
    with no_grad():
        return tensor.uniform_(a, b)


def constant_(tensor: Tensor, value: float) -> Tensor:
    with no_grad():
        return tensor.fill_(value)


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0)


__all__ = ["constant_", "normal_", "ones_", "uniform_", "zeros_"]
