"""Elementwise ops: arithmetic, comparisons, unary math, where/clamp, casts and copies.

Each function checks its arguments, computes the promoted dtype (PyTorch's rules, see
:mod:`blutrain.tensor.dtype`), casts tensor operands to it, calls the dispatched kernel on backend
arrays and wraps the result. Python scalars go to kernels as scalars, which the array modules treat
as weakly typed, so ``x * 2.0`` stays in x's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from blutrain.tensor import capture, dispatch
from blutrain.tensor.backend import is_writeable
from blutrain.tensor.base import Scalar, TensorBase
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import (
    FLOAT_UNARY_OPS,
    INTEGER_DTYPES,
    PROMOTION_TABLE,
    DType,
    as_dtype,
    bool_,
    get_default_dtype,
    int64,
    scalar_dtype,
)
from blutrain.tensor.errors import (
    AutogradError,
    DeviceMismatchError,
    ShapeError,
    TensorTypeError,
    TensorValueError,
)

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

_grad_mode = dispatch.grad_mode
_kernel = dispatch.kernel
_table = dispatch.TABLE  # read directly on the hottest path; _kernel fills it on a miss

COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
LOGICAL = frozenset({"logical_and", "logical_or", "logical_xor"})
BITWISE = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor"})
_FLOAT_UNARY = frozenset(FLOAT_UNARY_OPS)  # a set for the per-op membership test
_SCALARS = (bool, int, float)
_broadcast_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...]] = {}


def broadcast_shapes(a: tuple[int, ...], b: tuple[int, ...], op: str = "broadcast") -> tuple[int, ...]:
    """NumPy/PyTorch broadcasting of two shapes, with an error that shows both."""
    key = (a, b)
    found = _broadcast_cache.get(key)
    if found is not None:
        return found
    n = max(len(a), len(b))
    pa, pb = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(pa, pb, strict=True):
        if x != y and x != 1 and y != 1:
            raise ShapeError(f"{op}: shapes {list(a)} and {list(b)} cannot be broadcast together")
        out.append(y if x == 1 else x)
    res = tuple(out)
    if len(_broadcast_cache) < 4096:
        _broadcast_cache[key] = res
    return res


# Value range of each integer dtype: a Python int operand must fit the tensor's dtype, since the
# array modules refuse (NumPy 2) or wrap silently otherwise.
_INT_RANGE: dict[DType, tuple[int, int]] = {d: (int(np.iinfo(d.np).min), int(np.iinfo(d.np).max))
                                            for d in INTEGER_DTYPES}


def _scalar_result(t: DType, value: object, op: str) -> DType:
    """Promotion of a tensor dtype with a Python scalar: only a higher category changes it."""
    if isinstance(value, bool):
        return t
    if isinstance(value, int):
        if t is bool_:
            return int64
        bounds = _INT_RANGE.get(t)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise TensorValueError(f"{op}: the scalar {value} is out of range for a tensor of dtype {t.name} "
                                   f"([{bounds[0]}, {bounds[1]}]); convert the tensor first, e.g. .long()")
        return t
    if isinstance(value, float):
        return t if t.is_floating else get_default_dtype()
    raise TensorTypeError(f"{op}: expected a Tensor or a Python bool/int/float, got {type(value).__name__}")


def result_type(*operands: Tensor | Scalar) -> DType:
    """PyTorch's result type: dimensioned tensors, then 0-d tensors, then Python scalars. A later
    group changes the result only when its category is higher, and then gives its own dtype
    (for a float scalar, the default float dtype)."""
    groups: list[DType | None] = [None, None, None]
    for o in operands:
        if isinstance(o, TensorBase):
            g, d = (0 if o.ndim else 1), o.dtype
        else:
            g, d = 2, scalar_dtype(o)
        cur = groups[g]
        groups[g] = d if cur is None else PROMOTION_TABLE[(cur, d)]
    out: DType | None = None
    for found in groups:
        if found is not None and (out is None or found.category > out.category):
            out = found
    if out is None:
        raise TensorTypeError("result_type: expected at least one operand")
    return out


def _binary_dtype(op: str, a: Tensor | Scalar, b: Tensor | Scalar) -> tuple[DType, Device]:
    if isinstance(a, TensorBase):
        if isinstance(b, TensorBase):
            if a.device is not b.device:
                raise DeviceMismatchError(f"{op}: tensors are on different devices: {a.device} and {b.device}")
            if a.dtype is b.dtype:
                return a.dtype, a.device
            if (a.ndim == 0) == (b.ndim == 0):
                return PROMOTION_TABLE[(a.dtype, b.dtype)], a.device
            return result_type(a, b), a.device
        return _scalar_result(a.dtype, b, op), a.device
    if isinstance(b, TensorBase):
        return _scalar_result(b.dtype, a, op), b.device
    raise TensorTypeError(f"{op}: expected at least one Tensor, got {type(a).__name__} and {type(b).__name__}")


def _operand(x: Tensor | Scalar, dt: DType) -> Any:
    if isinstance(x, TensorBase):
        return x.array if x.dtype is dt else x.array.astype(dt.np)
    return x


def _special_dtype(op: str, dt: DType, b: Tensor | Scalar) -> DType:
    """The compute dtype of the binary ops that do not simply use the promoted dtype."""
    if op == "div":
        return dt if dt.is_floating else get_default_dtype()
    if op == "pow":
        if not dt.is_floating and _negative(b):
            raise TensorValueError(f"pow: integers to negative integer powers are not allowed (exponent "
                                   f"{b if not isinstance(b, TensorBase) else 'tensor'} for dtype {dt.name}); use a "
                                   "floating base")
        return dt
    if op in LOGICAL:
        return bool_
    if dt.is_floating:  # bitwise
        raise TensorTypeError(f"{op}: expected integer or bool tensors, got dtype {dt.name}")
    return dt


def _negative(b: Tensor | Scalar) -> bool:
    if isinstance(b, TensorBase):  # a host-side check only where reading the values is free
        return b.device.type == "cpu" and b.numel() > 0 and bool((b.array < 0).any())
    return isinstance(b, int) and b < 0


_SPECIAL = frozenset({"div", "pow", *LOGICAL, *BITWISE})


def binary(op: str, a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """``a <op> b`` with broadcasting and promotion; records for autograd when needed.

    This is the hot path of ``a + b``: one promotion, one dict lookup for the kernel, one call.
    """
    dt, dev = _binary_dtype(op, a, b)
    if op in _SPECIAL:
        dt = _special_dtype(op, dt, b)
    needs_grad = False
    # _binary_dtype has checked that a or b is a tensor: `host` (whose _make wraps the result) is set below
    if isinstance(a, TensorBase):
        xa = a.array if a.dtype is dt else a.array.astype(dt.np)
        needs_grad = a._rg
        host = a
    else:
        xa = a
    if isinstance(b, TensorBase):
        xb = b.array if b.dtype is dt else b.array.astype(dt.np)
        needs_grad = needs_grad or b._rg
        host = b
        if isinstance(a, TensorBase) and xa.shape != xb.shape:
            broadcast_shapes(xa.shape, xb.shape, op)
    else:
        xb = b
    fn = _table.get((op, dev.type, dt))
    if fn is None:
        fn = _kernel(op, dev.type, dt)
    res = host._make(fn(xa, xb), bool_ if op in COMPARISONS else dt, dev)
    if needs_grad and _grad_mode.enabled and op not in COMPARISONS:
        rec = dispatch.recorder
        if rec is not None:
            rec(op, (a, b), res, {})
    return res


def bitwise(kind: str, a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """``&``, ``|``, ``^``: the logical op when the operands promote to bool, else the bitwise one."""
    dt, _ = _binary_dtype(kind, a, b)
    return binary(("logical_" if dt is bool_ else "bitwise_") + kind, a, b)


def unary(op: str, x: Tensor, *args: Any) -> Tensor:
    """``op(x, *args)`` elementwise; integer inputs of float-only ops become the default float."""
    if not isinstance(x, TensorBase):
        raise TensorTypeError(f"{op}: expected a Tensor, got {type(x).__name__}")
    dt = x.dtype
    data = x.array
    if op in _FLOAT_UNARY and not dt.is_floating:
        dt = get_default_dtype()
        data = data.astype(dt.np)
    elif op == "logical_not" and dt is not bool_:
        dt, data = bool_, data.astype(bool)
    fn = _table.get((op, x.device.type, dt))
    if fn is None:
        fn = _kernel(op, x.device.type, dt)
    res = x._make(fn(data, *args), dt, x.device)
    if x._rg and _grad_mode.enabled:
        rec = dispatch.recorder
        if rec is not None:
            rec(op, (x,), res, {"args": args} if args else {})
    return res


def _check_inplace(op: str, target: Tensor, *others: Any) -> None:
    """Autograd records no in-place op: one on a tensor in a graph (or fed from one) is refused while
    grad mode is on, with the two ways out. ``op`` is the user-facing name (``add_``, ``setitem``)."""
    if _grad_mode.enabled and (target._rg or any(isinstance(o, TensorBase) and o._rg for o in others)):
        if not target._rg:
            kind = "a tensor that does not require grad, from one that does"
        elif target.grad_fn is None:
            kind = "a leaf tensor that requires grad"
        else:
            kind = "a tensor that is part of an autograd graph"
        raise AutogradError(
            f"{op}: in-place ops on {kind} are not recorded by autograd; use the out-of-place form, or wrap "
            "the update in blutrain.autograd.no_grad()")


def check_writable(op: str, target: Tensor) -> None:
    """In-place writes need memory of their own: an expanded view repeats one element many times."""
    if not is_writeable(target.array):
        raise TensorValueError(
            f"{op}: the target of shape {list(target.shape)} and strides {list(target.stride())} cannot be "  # type: ignore[arg-type]
            "written in place (an expanded view, or a read-only array); clone() it first")


def _write(op: str, target: Tensor, value: Any) -> Tensor:
    check_writable(op, target)
    found = capture.active()
    if found is None:
        target.array[...] = value
    else:  # a trace records the write, whichever array it goes to (state included)
        found.write(target.array, value)
    target.storage.version += 1
    return target


def inplace(op: str, target: Tensor, other: Tensor | Scalar) -> Tensor:
    """``target <op>= other``: computes in the promoted dtype, writes back, bumps the version."""
    _check_inplace(op + "_", target, other)
    dt, dev = _binary_dtype(op, target, other)
    if op == "div" and not dt.is_floating:
        dt = get_default_dtype()
    if dt.category > target.dtype.category:
        raise TensorTypeError(f"{op}_: result type {dt.name} cannot be written into a tensor of dtype "
                              f"{target.dtype.name}")
    if isinstance(other, TensorBase):
        shape = broadcast_shapes(target.shape, other.shape, op + "_")
        if shape != target.shape:
            raise ShapeError(f"{op}_: the result shape {list(shape)} does not fit the target's shape "
                             f"{list(target.shape)}")
    check_writable(op + "_", target)
    out = _kernel(op, dev.type, dt)(_operand(target, dt), _operand(other, dt))
    return _write(op + "_", target, out)


def assign(target: Tensor, src: Tensor, op: str = "copy_") -> Tensor:
    """``target.copy_(src)``: broadcasting, casting and moving between devices as needed."""
    if not isinstance(src, TensorBase):
        raise TensorTypeError(f"{op}: src must be a Tensor, got {type(src).__name__}")
    _check_inplace(op, target, src)
    if src.device is not target.device:
        src = to_device(src.detach(), target.device)
    if src.shape != target.shape:
        shape = broadcast_shapes(target.shape, src.shape, op)
        if shape != target.shape:
            raise ShapeError(f"{op}: src of shape {list(src.shape)} does not broadcast to {list(target.shape)}")
    return _write(op, target, src.array if src.dtype is target.dtype else src.array.astype(target.dtype.np))


def fill_(target: Tensor, value: Scalar | Tensor, op: str = "fill_") -> Tensor:
    _check_inplace(op, target, value)
    if isinstance(value, TensorBase):
        if value.numel() != 1:
            raise ShapeError(f"{op}: value must have one element, got shape {list(value.shape)}")
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise TensorTypeError(f"{op}: value must be a Python scalar or a one-element Tensor, got "
                              f"{type(value).__name__}")
    if isinstance(value, float) and not target.dtype.is_floating:
        raise TensorTypeError(f"{op}: cannot write the float {value} into a tensor of dtype {target.dtype.name}")
    return _write(op, target, value)


def copy(x: Tensor) -> Tensor:
    """A contiguous copy that autograd sees as identity."""
    out = x._make(_kernel("copy", x.device.type, x.dtype)(x.array), x.dtype, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("copy", (x,), out, {})
    return out


def cast(x: Tensor, dtype: DType | str) -> Tensor:
    dt = as_dtype(dtype)
    out = x._make(_kernel("cast", x.device.type, x.dtype)(x.array, dt.np), dt, x.device)
    if x._rg and dt.is_floating and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("cast", (x,), out, {"dtype": x.dtype})
    return out


def to_device(x: Tensor, dev: Device) -> Tensor:
    src_backend, dst_backend = x.device.backend, dev.backend
    host = src_backend.to_host(x.array)
    data = dst_backend.from_host(host, dev.index) if dev.type != "cpu" else host.copy() if host is x.array else host
    out = x._make(data, x.dtype, dev)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("to_device", (x,), out, {"device": x.device})
    return out


def where(condition: Tensor, input: Tensor | Scalar, other: Tensor | Scalar) -> Tensor:
    """Elements of ``input`` where ``condition`` holds, else of ``other``."""
    if not isinstance(condition, TensorBase) or condition.dtype is not bool_:
        got = condition.dtype.name if isinstance(condition, TensorBase) else type(condition).__name__
        raise TensorTypeError(f"where: condition must be a bool Tensor, got {got}")
    if isinstance(input, TensorBase) or isinstance(other, TensorBase):
        dt, dev = _binary_dtype("where", input, other)
    else:
        dt, dev = result_type(input, other), condition.device
    if condition.device is not dev:
        raise DeviceMismatchError(f"where: condition is on {condition.device}, values on {dev}")
    shapes = [condition.shape] + [o.shape for o in (input, other) if isinstance(o, TensorBase)]
    shape = shapes[0]
    for s in shapes[1:]:
        shape = broadcast_shapes(shape, s, "where")
    out = _kernel("where", dev.type, dt)(condition.array, _operand(input, dt), _operand(other, dt))
    res = condition._make(out, dt, dev)
    if (_grad_mode.enabled and dispatch.recorder is not None
            and any(isinstance(o, TensorBase) and o._rg for o in (input, other))):
        dispatch.recorder("where", (input, other), res, {"condition": condition})
    return res


def masked_fill(x: Tensor, mask: Tensor, value: Scalar | Tensor) -> Tensor:
    """``x`` with ``value`` where ``mask`` is True (mask broadcasts to x); the dtype stays x's."""
    if not isinstance(x, TensorBase):
        raise TensorTypeError(f"masked_fill: input must be a Tensor, got {type(x).__name__}")
    if not isinstance(mask, TensorBase) or mask.dtype is not bool_:
        raise TensorTypeError(f"masked_fill: mask must be a bool Tensor, got {getattr(mask, 'dtype', type(mask))}")
    if mask.device is not x.device:
        raise DeviceMismatchError(f"masked_fill: mask is on {mask.device}, input on {x.device}")
    if isinstance(value, TensorBase):
        if value.numel() != 1:
            raise ShapeError(f"masked_fill: value must be a scalar or a one-element tensor, got shape "
                             f"{list(value.shape)}")
        value = value.item()
    if isinstance(value, float) and not x.dtype.is_floating:
        raise TensorTypeError(f"masked_fill: cannot fill a tensor of dtype {x.dtype.name} with the float {value}")
    if broadcast_shapes(x.shape, mask.shape, "masked_fill") != x.shape:
        raise ShapeError(f"masked_fill: mask of shape {list(mask.shape)} does not broadcast to {list(x.shape)}")
    fill = x.array.dtype.type(value)  # a value of x's dtype: the result keeps x's dtype
    out = x._make(_kernel("where", x.device.type, x.dtype)(mask.array, fill, x.array), x.dtype, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("where", (value, x), out, {"condition": mask})
    return out


def clamp(x: Tensor, min: Scalar | Tensor | None = None, max: Scalar | Tensor | None = None) -> Tensor:
    if min is None and max is None:
        raise TensorTypeError("clamp: at least one of min and max must be given")
    if isinstance(min, TensorBase) or isinstance(max, TensorBase):
        out = x
        if min is not None:
            out = binary("maximum", out, min)
        if max is not None:
            out = binary("minimum", out, max)
        return out
    dt = x.dtype
    for v in (min, max):
        if v is not None:
            dt = _scalar_result(dt, v, "clamp")
    out_data = _kernel("clamp", x.device.type, dt)(_operand(x, dt), min, max)
    res = x._make(out_data, dt, x.device)
    if x._rg and _grad_mode.enabled and dispatch.recorder is not None:
        dispatch.recorder("clamp", (x,), res, {"min": min, "max": max})
    return res


# -- the functional API ------------------------------------------------------------------------
def add(input: Tensor | Scalar, other: Tensor | Scalar, *, alpha: Scalar = 1) -> Tensor:
    return binary("add", input, other if alpha == 1 else other * alpha)


def sub(input: Tensor | Scalar, other: Tensor | Scalar, *, alpha: Scalar = 1) -> Tensor:
    return binary("sub", input, other if alpha == 1 else other * alpha)


def mul(input: Tensor | Scalar, other: Tensor | Scalar) -> Tensor:
    return binary("mul", input, other)


def div(input: Tensor | Scalar, other: Tensor | Scalar) -> Tensor:
    return binary("div", input, other)


def pow(input: Tensor | Scalar, exponent: Tensor | Scalar) -> Tensor:
    return binary("pow", input, exponent)


def maximum(input: Tensor, other: Tensor) -> Tensor:
    return binary("maximum", input, other)


def minimum(input: Tensor, other: Tensor) -> Tensor:
    return binary("minimum", input, other)


def eq(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("eq", input, other)


def ne(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("ne", input, other)


def lt(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("lt", input, other)


def le(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("le", input, other)


def gt(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("gt", input, other)


def ge(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("ge", input, other)


def logical_and(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("logical_and", input, other)


def logical_or(input: Tensor, other: Tensor | Scalar) -> Tensor:
    return binary("logical_or", input, other)


def logical_not(input: Tensor) -> Tensor:
    return unary("logical_not", input)


def neg(input: Tensor) -> Tensor:
    return unary("neg", input)


def exp(input: Tensor) -> Tensor:
    return unary("exp", input)


def log(input: Tensor) -> Tensor:
    return unary("log", input)


def log1p(input: Tensor) -> Tensor:
    return unary("log1p", input)


def expm1(input: Tensor) -> Tensor:
    return unary("expm1", input)


def sqrt(input: Tensor) -> Tensor:
    return unary("sqrt", input)


def rsqrt(input: Tensor) -> Tensor:
    return unary("rsqrt", input)


def tanh(input: Tensor) -> Tensor:
    return unary("tanh", input)


def sigmoid(input: Tensor) -> Tensor:
    return unary("sigmoid", input)


def sin(input: Tensor) -> Tensor:
    return unary("sin", input)


def cos(input: Tensor) -> Tensor:
    return unary("cos", input)


def abs(input: Tensor) -> Tensor:
    return unary("abs", input)


def sign(input: Tensor) -> Tensor:
    return unary("sign", input)


def erf(input: Tensor) -> Tensor:
    return unary("erf", input)


def relu(input: Tensor) -> Tensor:
    return unary("relu", input)


def silu(input: Tensor) -> Tensor:
    return unary("silu", input)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact (``approximate='none'``, through erf) or GPT-2's tanh form (``'tanh'``)."""
    if approximate not in ("none", "tanh"):
        raise TensorTypeError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return unary("gelu", input, approximate)


def uniform_(x: Tensor, a: float, b: float) -> Tensor:
    """Fill ``x`` in place with samples of U(a, b) from its device's generator."""
    _check_inplace("uniform_", x)
    check_writable("uniform_", x)
    sample = x.device.backend.generator(x.device.index).uniform(x.shape, x.dtype)
    x.array[...] = sample * (b - a) + a
    x.storage.version += 1
    return x


def normal_(x: Tensor, mean: float, std: float) -> Tensor:
    """Fill ``x`` in place with samples of N(mean, std²) from its device's generator."""
    _check_inplace("normal_", x)
    check_writable("normal_", x)
    sample = x.device.backend.generator(x.device.index).normal(x.shape, x.dtype)
    x.array[...] = sample * std + mean
    x.storage.version += 1
    return x
