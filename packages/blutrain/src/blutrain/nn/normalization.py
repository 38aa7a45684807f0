"""LayerNorm over the trailing dims: one fused op that keeps mean and rstd for backward."""

from __future__ import annotations

from collections.abc import Sequence

from blutrain.nn.errors import ModuleError
from blutrain.nn.module import Module
from blutrain.nn.parameter import Parameter
from blutrain.tensor import DType, Tensor, layer_norm, ones, zeros
from blutrain.tensor.device import Device


class LayerNorm(Module):
    """``weight`` ones and ``bias`` zeros of ``normalized_shape`` (either can be turned off)."""

    weight: Parameter | None
    bias: Parameter | None

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *, device: str | Device | None = None,
                 dtype: DType | str | None = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in shape):
            raise ModuleError(f"LayerNorm: normalized_shape must be positive ints, got {normalized_shape!r}")
        if eps <= 0:
            raise ModuleError(f"LayerNorm: eps must be positive, got {eps}")
        self.normalized_shape = shape
        self.eps = float(eps)
        if elementwise_affine:
            self.weight = Parameter(ones(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = Parameter(zeros(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{list(self.normalized_shape)}, eps={self.eps}, elementwise_affine={self.weight is not None}"


__all__ = ["LayerNorm"]
