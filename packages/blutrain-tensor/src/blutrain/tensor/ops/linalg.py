"""Matrix products: matmul (NumPy/PyTorch broadcasting of batch dims), bmm, linear and linear_add.

``linear`` is its own op, not matmul plus add, so that a device can run it as one GEMM with a bias
epilogue (cuBLASLt does); ``linear_add`` adds a residual in the same epilogue (a transformer block's
``x + proj(y)``), so that neither the product nor the sum is a pass over memory of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor import dispatch
from blutrain.tensor.autocast import lower
from blutrain.tensor.autocast import state as autocast_state
from blutrain.tensor.base import TensorBase
from blutrain.tensor.dtype import float32
from blutrain.tensor.errors import DeviceMismatchError, ShapeError, TensorTypeError

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

_grad_mode = dispatch.grad_mode
_autocast = autocast_state
_kernel = dispatch.kernel


def _check_pair(op: str, a: Tensor, b: Tensor, names: tuple[str, str] = ("input", "other")) -> None:
    na, nb = names
    if not isinstance(a, TensorBase) or not isinstance(b, TensorBase):
        raise TensorTypeError(f"{op}: expected {na} and {nb} to be Tensors, got {type(a).__name__} and "
                              f"{type(b).__name__}")
    if a.device is not b.device:
        raise DeviceMismatchError(f"{op}: {nb} is on {b.device}, {na} on {a.device}; expected both on one device")
    if a.dtype is not b.dtype:
        raise TensorTypeError(f"{op}: {nb} has dtype {b.dtype.name}, {na} has {a.dtype.name}; expected the same "
                              "dtype (convert one with .to(dtype))")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"{op}: {na} and {nb} need at least 1 dim, got shapes {list(a.shape)} and {list(b.shape)}")


def _check_weight(op: str, x: Tensor, weight: Tensor) -> None:
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"{op}: input of shape {list(x.shape)} does not fit weight of shape "
                         f"{list(weight.shape)} (expected input[..., {weight.shape[-1]}])")


def _check_bias(op: str, weight: Tensor, bias: Tensor) -> None:
    if bias.shape != (weight.shape[0],):
        raise ShapeError(f"{op}: bias must have shape [{weight.shape[0]}] (out_features of weight "
                         f"{list(weight.shape)}), got {list(bias.shape)}")


def _linear_operands(op: str, x: Tensor, weight: Tensor, bias: Tensor | None
                     ) -> tuple[bool, Tensor, Tensor, Tensor | None]:
    """(narrowed, x, weight, bias) of a linear layer's op: under autocast each floating operand of another
    dtype rounded to the region's (``_narrow``), then checked (one device and dtype, fitting shapes)."""
    narrowed = _autocast.dtype is not None and any(
        isinstance(t, TensorBase) and t.dtype.is_floating and t.dtype is not _autocast.dtype for t in (x, weight, bias))
    if narrowed:
        x, weight = _narrow(x), _narrow(weight)
        bias = None if bias is None else _narrow(bias)
    _check_pair(op, x, weight, ("input", "weight"))
    _check_weight(op, x, weight)
    if bias is not None:
        _check_pair(op, x, bias, ("input", "bias"))
        _check_bias(op, weight, bias)
    return narrowed, x, weight, bias


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with broadcast batch dims; 1-D operands are vectors, as in PyTorch."""
    if _autocast.dtype is not None:
        a, b = lower(a), lower(b)
    _check_pair("matmul", a, b)
    k_a = a.shape[-1]
    k_b = b.shape[-2] if b.ndim > 1 else b.shape[0]
    if k_a != k_b:
        raise ShapeError(f"matmul: shapes {list(a.shape)} and {list(b.shape)} cannot be multiplied "
                         f"({k_a} != {k_b})")
    if a.ndim > 2 and b.ndim > 2:
        from blutrain.tensor.ops.elementwise import broadcast_shapes

        broadcast_shapes(a.shape[:-2], b.shape[:-2], "matmul (batch dims)")
    out = a._make(_kernel("matmul", a.device.type, a.dtype)(a.array, b.array), a.dtype, a.device)
    if _grad_mode.enabled and (a._rg or b._rg) and dispatch.recorder is not None:
        dispatch.recorder("matmul", (a, b), out, {})
    return out


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """Batched product of (B, n, k) and (B, k, m)."""
    _check_pair("bmm", a, b)
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ShapeError(f"bmm: expected (B, n, k) and (B, k, m), got {list(a.shape)} and {list(b.shape)}")
    return matmul(a, b)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with weight of shape (out_features, in_features).

    Under autocast the operands are rounded to the region's dtype inside the op and the product is
    in that dtype, as with separate casts; but the gradients of float32 operands come out of the
    backward GEMMs' float32 accumulators in float32, where a cast's backward would receive them
    rounded to the half dtype (one rounding and one cast kernel less per gradient).
    """
    originals = (x, weight, bias)
    narrowed, x, weight, bias = _linear_operands("linear", x, weight, bias)
    out_data = _kernel("linear", x.device.type, x.dtype)(x.array, weight.array,
                                                          None if bias is None else bias.array)
    out = x._make(out_data, x.dtype, x.device)
    if not _grad_mode.enabled or dispatch.recorder is None:
        return out
    if narrowed:
        if any(t is not None and t._rg for t in originals):
            dispatch.recorder("linear_autocast", originals, out, {
                "x": x, "weight": weight, "dtypes": tuple(None if t is None else t.dtype for t in originals)})
    elif x._rg or weight._rg or (bias is not None and bias._rg):
        dispatch.recorder("linear", (x, weight, bias), out, {})
    return out


def linear_gelu(input: Tensor, weight: Tensor, bias: Tensor | None = None, approximate: str = "tanh") -> Tensor:
    """``gelu(linear(input, weight, bias), approximate)``: a transformer MLP's first projection and its
    activation, which a device may run as one GEMM whose epilogue adds the bias and applies GELU (cuBLASLt's
    GELU epilogue, the tanh form, for half dtypes on cuda). The backward reads the pre-activation the
    forward kept (the size of the output), as ``gelu`` after ``linear`` would.

    Under autocast the operands are rounded to the region's dtype as ``linear`` rounds them; the result is
    in that dtype, and the gradients of float32 input and weight come out in float32.
    """
    if approximate not in ("none", "tanh"):
        from blutrain.tensor.errors import TensorValueError

        raise TensorValueError(f"linear_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    originals = (input, weight, bias)
    _, input, weight, bias = _linear_operands("linear_gelu", input, weight, bias)
    if not input.dtype.is_floating:
        raise TensorTypeError(f"linear_gelu: input must be floating, got {input.dtype.name}")
    out_data, pre_data = _kernel("linear_gelu", input.device.type, input.dtype)(
        input.array, weight.array, None if bias is None else bias.array, approximate)
    out = input._make(out_data, input.dtype, input.device)
    if (_grad_mode.enabled and dispatch.recorder is not None
            and any(t is not None and t._rg for t in originals)):
        dispatch.recorder("linear_gelu", originals, out, {
            "x": input, "weight": weight, "pre": input._make(pre_data, input.dtype, input.device),
            "approximate": approximate, "dtypes": tuple(None if t is None else t.dtype for t in originals)})
    return out


def linear_add(residual: Tensor, input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``residual + linear(input, weight, bias)`` in one GEMM whose epilogue adds the bias and the residual,
    in ``residual``'s dtype (``residual`` has the product's shape: no broadcasting).

    Outside autocast all four share one dtype and the result is the two ops' to rounding. Under autocast
    ``input`` and ``weight`` are rounded to the region's dtype as ``linear`` rounds them, while ``bias``
    and ``residual`` keep theirs (float32 or the region's, one for both): the product is added to them
    from the GEMM's float32 accumulators, without the rounding to the half dtype that ``linear`` followed
    by ``+`` makes, and the result (and so the residual stream) stays float32.
    """
    if not isinstance(residual, TensorBase):
        raise TensorTypeError(f"linear_add: residual must be a Tensor, got {type(residual).__name__}")
    narrowed = _autocast.dtype is not None and any(
        isinstance(t, TensorBase) and t.dtype.is_floating and t.dtype is not _autocast.dtype for t in (input, weight))
    originals = (residual, input, weight, bias)
    if narrowed:
        input, weight = _narrow(input), _narrow(weight)
    _check_pair("linear_add", input, weight, ("input", "weight"))
    if not input.dtype.is_floating:
        raise TensorTypeError(f"linear_add: input must be floating, got {input.dtype.name}")
    _check_weight("linear_add", input, weight)
    out_shape = (*input.shape[:-1], weight.shape[0])
    if residual.device is not input.device:
        raise DeviceMismatchError(f"linear_add: residual is on {residual.device}, input on {input.device}; "
                                  "expected both on one device")
    if residual.shape != out_shape:
        raise ShapeError(f"linear_add: residual must have the product's shape {list(out_shape)}, got "
                         f"{list(residual.shape)}")
    allowed = (input.dtype, float32) if _autocast.dtype is not None else (input.dtype,)
    if residual.dtype not in allowed:
        want = " or ".join(d.name for d in allowed)
        raise TensorTypeError(f"linear_add: residual must have dtype {want}, got {residual.dtype.name}")
    if bias is not None:
        if not isinstance(bias, TensorBase):
            raise TensorTypeError(f"linear_add: bias must be a Tensor or None, got {type(bias).__name__}")
        if bias.device is not input.device:
            raise DeviceMismatchError(f"linear_add: bias is on {bias.device}, input on {input.device}; "
                                      "expected both on one device")
        if bias.dtype is not residual.dtype:
            raise TensorTypeError(f"linear_add: bias must have the residual's dtype {residual.dtype.name}, got "
                                  f"{bias.dtype.name}")
        _check_bias("linear_add", weight, bias)
    out_data = _kernel("linear_add", input.device.type, input.dtype)(
        residual.array, input.array, weight.array, None if bias is None else bias.array)
    out = input._make(out_data, residual.dtype, input.device)
    if (_grad_mode.enabled and dispatch.recorder is not None
            and any(t is not None and t._rg for t in originals)):
        dispatch.recorder("linear_add", originals, out, {
            "x": input, "weight": weight, "dtypes": tuple(None if t is None else t.dtype for t in originals)})
    return out


def _narrow(t: Tensor) -> Tensor:
    """``t`` in the autocast dtype, converted by the cast kernel but not recorded as a cast: the op that
    calls this records itself against ``t`` and keeps the narrow copy for its backward."""
    dt = _autocast.dtype
    if dt is None or not isinstance(t, TensorBase) or not t.dtype.is_floating or t.dtype is dt:
        return t
    return t._make(_kernel("cast", t.device.type, t.dtype)(t.array, dt.np), dt, t.device)
