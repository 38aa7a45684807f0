"""LayerNorm and RMSNorm over the trailing dims: one fused op each, keeping only per-row statistics for
backward (mean and rstd; rstd)."""

from __future__ import annotations

from collections.abc import Sequence

from blutrain.nn.errors import ModuleError
from blutrain.nn.module import Module
from blutrain.nn.parameter import Parameter
from blutrain.tensor import DType, Tensor, layer_norm, ones, rms_norm, zeros
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


class RMSNorm(Module):
    """``x / sqrt(mean(x²) + eps) * weight`` over ``normalized_shape`` (Llama's norm), ``weight`` ones."""

    weight: Parameter

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, device: str | Device | None = None,
                 dtype: DType | str | None = None) -> None:
        super().__init__()
        if isinstance(normalized_shape, bool) or not isinstance(normalized_shape, int) or normalized_shape <= 0:
            raise ModuleError(f"RMSNorm: normalized_shape must be a positive int, got {normalized_shape!r}")
        if not eps > 0:
            raise ModuleError(f"RMSNorm: eps must be positive, got {eps}")
        self.normalized_shape = normalized_shape
        self.eps = float(eps)
        self.weight = Parameter(ones(normalized_shape, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


__all__ = ["LayerNorm", "RMSNorm"]
