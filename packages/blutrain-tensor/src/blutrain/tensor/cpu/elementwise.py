"""Generic elementwise kernels: array module from the inputs, dtype from the caller.

Inputs arrive already cast to the op's compute dtype (or as Python scalars, which the array
modules treat as weakly typed). Numerically delicate forms are chosen for range, not brevity:
sigmoid never evaluates exp of a positive number, so it cannot overflow.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from blutrain.tensor.backend import array_backend, array_module

Array = Any
_quiet = functools.partial(np.errstate, all="ignore")  # NaN/inf results are values, as in PyTorch, not warnings
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def add(a: Array, b: Array) -> Array:
    return a + b


def sub(a: Array, b: Array) -> Array:
    return a - b


def mul(a: Array, b: Array) -> Array:
    return a * b


def div(a: Array, b: Array) -> Array:
    with _quiet():
        return a / b


def pow(a: Array, b: Array) -> Array:
    with _quiet():
        return a**b


def floor_divide(a: Array, b: Array) -> Array:
    with _quiet():
        return a // b


def remainder(a: Array, b: Array) -> Array:
    with _quiet():
        return a % b


def maximum(a: Array, b: Array) -> Array:
    return array_module(a if not isinstance(a, (int, float)) else b).maximum(a, b)


def minimum(a: Array, b: Array) -> Array:
    return array_module(a if not isinstance(a, (int, float)) else b).minimum(a, b)


def eq(a: Array, b: Array) -> Array:
    return a == b


def ne(a: Array, b: Array) -> Array:
    return a != b


def lt(a: Array, b: Array) -> Array:
    return a < b


def le(a: Array, b: Array) -> Array:
    return a <= b


def gt(a: Array, b: Array) -> Array:
    return a > b


def ge(a: Array, b: Array) -> Array:
    return a >= b


def logical_and(a: Array, b: Array) -> Array:
    return a & b


def logical_or(a: Array, b: Array) -> Array:
    return a | b


def logical_xor(a: Array, b: Array) -> Array:
    return a ^ b


def bitwise_and(a: Array, b: Array) -> Array:
    return a & b


def bitwise_or(a: Array, b: Array) -> Array:
    return a | b


def bitwise_xor(a: Array, b: Array) -> Array:
    return a ^ b


def bitwise_not(a: Array) -> Array:
    return ~a


def logical_not(a: Array) -> Array:
    return ~a


def neg(a: Array) -> Array:
    return -a


def abs(a: Array) -> Array:
    return array_module(a).abs(a)


def sign(a: Array) -> Array:
    return array_module(a).sign(a)


def exp(a: Array) -> Array:
    with _quiet():
        return array_module(a).exp(a)


def expm1(a: Array) -> Array:
    with _quiet():
        return array_module(a).expm1(a)


def log(a: Array) -> Array:
    with _quiet():
        return array_module(a).log(a)


def log1p(a: Array) -> Array:
    with _quiet():
        return array_module(a).log1p(a)


def sqrt(a: Array) -> Array:
    with _quiet():
        return array_module(a).sqrt(a)


def rsqrt(a: Array) -> Array:
    with _quiet():
        return 1 / array_module(a).sqrt(a)


def tanh(a: Array) -> Array:
    return array_module(a).tanh(a)


def sin(a: Array) -> Array:
    return array_module(a).sin(a)


def cos(a: Array) -> Array:
    return array_module(a).cos(a)


def sigmoid(a: Array) -> Array:
    xp = array_module(a)
    e = xp.exp(-xp.abs(a))
    return xp.where(a >= 0, 1 / (1 + e), e / (1 + e))


def relu(a: Array) -> Array:
    return array_module(a).maximum(a, 0)


def silu(a: Array) -> Array:
    return a * sigmoid(a)


def erf(a: Array) -> Array:
    # the array modules have no erf: the backend that owns the array supplies it
    return array_backend(a).erf(a)


def gelu(a: Array, approximate: str = "none") -> Array:
    xp = array_module(a)
    if approximate == "tanh":
        # 0.5·a·(1 + tanh(√(2/π)·a·(1 + 0.044715·a²))), computed in one buffer: on the CPU the
        # temporaries of the textbook form cost more than the arithmetic
        t = xp.multiply(a, a, out=xp.empty_like(a))  # out= keeps 0-d results arrays
        t *= 0.044715
        t += 1
        t *= a
        t *= _SQRT_2_OVER_PI
        xp.tanh(t, out=t)
        t += 1
        t *= a
        t *= 0.5
        return t
    return 0.5 * a * (1 + erf(a * _INV_SQRT_2))


def gelu_backward(grad: Array, a: Array, approximate: str = "none") -> Array:
    xp = array_module(a)
    if approximate == "tanh":
        # d/da = 0.5·(1 + t) + 0.5·a·(1 − t²)·√(2/π)·(1 + 3·0.044715·a²), t = tanh(inner); three buffers
        a2 = xp.multiply(a, a, out=xp.empty_like(a))  # out= keeps 0-d results arrays
        t = xp.multiply(a2, 0.044715, out=xp.empty_like(a))
        t += 1
        t *= a
        t *= _SQRT_2_OVER_PI
        xp.tanh(t, out=t)
        a2 *= 3 * 0.044715 * _SQRT_2_OVER_PI
        a2 += _SQRT_2_OVER_PI  # a2 now holds d(inner)/da
        u = xp.multiply(t, t, out=xp.empty_like(a))
        xp.subtract(1, u, out=u)
        u *= a2
        u *= a
        u *= 0.5
        t += 1
        t *= 0.5
        t += u
        t *= grad
        return t
    cdf = 0.5 * (1 + erf(a * _INV_SQRT_2))
    pdf = _INV_SQRT_2PI * xp.exp(-0.5 * a * a)
    return grad * (cdf + a * pdf)


def where(cond: Array, a: Array, b: Array) -> Array:
    xp = array_module(cond)
    return xp.where(cond, a, b)


def clamp(a: Array, lo: float | None, hi: float | None) -> Array:
    return array_module(a).clip(a, lo, hi)


def copy(a: Array) -> Array:
    return a.copy()


def cast(a: Array, dtype: Any) -> Array:
    return a.astype(dtype)


def full(shape: tuple[int, ...], value: float, dtype: Any) -> Array:
    return np.full(shape, value, dtype=dtype)


def arange(start: float, end: float, step: float, dtype: Any) -> Array:
    exact = np.int64 if np.dtype(dtype).kind in "iub" else np.float64  # bfloat16 is kind "V"
    return np.arange(start, end, step, dtype=exact).astype(dtype)


def linspace(start: float, end: float, steps: int, dtype: Any) -> Array:
    return np.linspace(start, end, steps, dtype=np.float64).astype(dtype)


def eye(n: int, m: int, dtype: Any) -> Array:
    return np.eye(n, m, dtype=dtype)


BINARY = ("add", "sub", "mul", "div", "pow", "floor_divide", "remainder", "maximum", "minimum")
COMPARISON = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL = ("logical_and", "logical_or", "logical_xor", "logical_not")
BITWISE = ("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not")
UNARY_ANY = ("neg", "abs", "sign", "relu")
