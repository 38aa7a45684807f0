"""Linear: y = x Wᵀ + b, one dispatched ``linear`` op (a GEMM with a bias epilogue where fused); and
``project``, a block's output projection with its residual added in the same GEMM."""

from __future__ import annotations

import math

from blutrain.nn import init
from blutrain.nn.activation import Dropout
from blutrain.nn.errors import ModuleError
from blutrain.nn.module import Module, is_plain
from blutrain.nn.parameter import Parameter
from blutrain.tensor import DType, Tensor, empty, linear, linear_add
from blutrain.tensor.device import Device


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModuleError(f"{name} must be a positive int, got {value!r}")
    return value


class Linear(Module):
    """``weight`` (out_features, in_features), ``bias`` (out_features) or None.

    Initialised as PyTorch's: uniform in ±1/sqrt(in_features) for both (models such as GPT-2
    re-initialise explicitly).
    """

    weight: Parameter
    bias: Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device: str | Device | None = None, dtype: DType | str | None = None) -> None:
        super().__init__()
        self.in_features = _positive("Linear: in_features", in_features)
        self.out_features = _positive("Linear: out_features", out_features)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = Parameter(init.uniform_(empty(out_features, in_features, device=device, dtype=dtype),
                                              -bound, bound))
        if bias:
            bias_t = empty(out_features, device=device, dtype=dtype)
            self.bias = Parameter(init.uniform_(bias_t, -bound, bound))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def project(proj: Module, drop: Module, y: Tensor, residual: Tensor | None) -> Tensor:
    """``drop(proj(y))``, plus ``residual`` when given: in one GEMM (``linear_add``, the residual added by the
    epilogue) where ``proj`` is a plain Linear and neither module does anything else (hooks, or dropout
    that zeroes in training); a transformer block's output projections (attention's and the MLP's)."""
    if residual is None:
        out: Tensor = drop(proj(y))
        return out
    if is_plain(proj, Linear) and is_plain(drop, Dropout) and not (drop.training and drop.p > 0.0):
        return linear_add(residual, y, proj.weight, proj.bias)
    summed: Tensor = residual + drop(proj(y))
    return summed


__all__ = ["Linear", "project"]
