"""GPT-2's tanh GELU, written as ``x · sigmoid(2u)`` instead of ``0.5 · x · (1 + tanh(u))``.

With ``u = √(2/π) · (x + 0.044715 · x³)`` the two forms are equal, because ``0.5 · (1 + tanh(u)) =
1 / (1 + e^(−2u))``; the second needs one exponential and one division and no tanh. For x ≪ 0,
``e^(−2u)`` overflows to +inf and the result is ``x / inf = −0``, the correct limit, so no clamp is
needed. float16 and bfloat16 inputs are computed in float32 and rounded once, as the built-in
kernels do. ``approximate="none"`` (the erf form) is not what this plugin replaces: it calls the
built-in kernel.

Kernels receive backend arrays (NumPy on "cpu", CuPy on "cuda"), any layout, and return a new array
of the input's dtype and shape, never a NumPy scalar.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from blutrain.tensor.cpu import elementwise as builtin
from blutrain.tensor.dtype import HALF_NAMES

Array = Any  # a backend array: numpy.ndarray here, cupy.ndarray in gelu_cuda
# −2·√(2/π): u and the sign of the exponent folded into one constant
MINUS_TWO_SQRT_2_OVER_PI = -2.0 * math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


def gelu_tanh_numpy(x: Array) -> Array:
    """The cpu kernel body: one working buffer, updated in place (temporaries cost more than the math)."""
    compute = np.float64 if x.dtype == np.float64 else np.float32
    t = x.astype(compute)  # a fresh array: float32 for half inputs, a copy otherwise
    v = t.copy()
    t *= t
    t *= CUBIC
    t += 1.0
    t *= v
    t *= MINUS_TWO_SQRT_2_OVER_PI  # t = −2u
    with np.errstate(over="ignore"):  # e^(−2u) = inf for x ≪ 0 is intended: x / inf = −0
        np.exp(t, out=t)
    t += 1.0
    np.divide(v, t, out=t)
    return t.astype(x.dtype, copy=False)


def gelu_cpu(x: Array, approximate: str = "none") -> Array:
    """Kernel "gelu" on device "cpu"."""
    if approximate == "tanh":
        return gelu_tanh_numpy(x)
    wide = x.astype(np.float32) if x.dtype.name in HALF_NAMES else x
    return np.asarray(builtin.gelu(wide, approximate)).astype(x.dtype, copy=False)


@functools.cache
def _cupy_kernel() -> Any:
    """The CuPy ElementwiseKernel, compiled once per process on first use (CuPy caches the binary)."""
    import cupy

    return cupy.ElementwiseKernel(
        "T x", "T y",
        f"T e = exp(x * ((T)1 + (T){CUBIC!r} * x * x) * (T){MINUS_TWO_SQRT_2_OVER_PI!r});"
        "y = x / ((T)1 + e);",
        "blutrain_example_gelu_tanh",
    )


def gelu_cuda(x: Array, approximate: str = "none") -> Array:
    """Kernel "gelu" on device "cuda": one launch for float32/float64, a cast either side for halves."""
    half = x.dtype.name in HALF_NAMES
    wide = x.astype("float32") if half else x
    y = _cupy_kernel()(wide) if approximate == "tanh" else builtin.gelu(wide, approximate)
    return y.astype(x.dtype) if half else y
