"""Activations and dropout as modules (their math is the functional op of the same name)."""

from __future__ import annotations

from blutrain.nn.errors import ModuleError
from blutrain.nn.module import Module
from blutrain.tensor import Tensor, dropout, gelu


class GELU(Module):
    """GELU, exact (``approximate='none'``) or GPT-2's tanh approximation (``'tanh'``)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ModuleError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Dropout(Module):
    """Zeroes elements with probability ``p`` in training mode (scaling the rest by 1/(1-p));
    identity in eval mode."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ModuleError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"


__all__ = ["GELU", "Dropout"]
