"""Launchers of ``half_elementwise.cu``: bfloat16/float16 elementwise ops in one launch each, computed in float32
registers and rounded once, bit for bit as the cuda backend's generic path for half precision computes them
(widen each operand with the cast kernel, CuPy's float32 ufunc, narrow with the cast kernel: four launches and
three temporaries for ``a + b``).

Each launcher takes the generic kernel's arguments (CuPy arrays of the op's dtype, Python scalars as the op
functions pass them) and returns None where its kernels do not cover the call, for the generic kernel to run:
another dtype, a strided view, operands of different dtypes, a broadcast other than one operand being a scalar
(a Python number, a 0-d or one-element array), repeating along the other's leading dims (a row ``(C,)`` or
``(T, C)`` over ``(B, T, C)``) or along its trailing dims (a column ``(B, T, 1)`` over ``(B, T, C)``).

The per-call path is plain: the kernel function, the grid, the broadcast plan of a pair of shapes and the packed
op codes are cached (a dictionary lookup each), a Python scalar is packed once as float32, and nothing imports,
builds a device object or copies an operand that is already contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import _NULL, Array, Registry, _cp, _elementwise_grid, function
from blutrain.tensor.dtype import bfloat16, float16

FAMILY = "half_elementwise"
_BLOCK = (256,)
# storage dtype -> half_elementwise.cu's name of it
_SHORT: dict[np.dtype[Any], str] = {bfloat16.np: "bf16", float16.np: "f16"}
_HALF_NAMES = ("bfloat16", "float16")
_BOOL = np.dtype(np.bool_)

# op codes of half_elementwise.cu (its opening comment lists them)
ARITHMETIC = {"add": 0, "sub": 1, "mul": 2, "div": 3, "maximum": 4, "minimum": 5, "pow": 6}
COMPARISONS = {"eq": 0, "ne": 1, "lt": 2, "le": 3, "gt": 4, "ge": 5}
UNARY = {"neg": 0, "abs": 1, "exp": 2, "expm1": 3, "log": 4, "log1p": 5, "sqrt": 6, "rsqrt": 7, "tanh": 8,
         "sin": 9, "cos": 10, "relu": 11}
_SQRT, _SQUARE, _RECIPROCAL, _POW_SCALAR = 6, 12, 13, 14
_MIRRORED = {0: 0, 1: 1, 2: 4, 3: 5, 4: 2, 5: 3}  # y op x is x mirrored-op y (y < x is x > y)

# how the second operand reaches the kernel (half_elementwise.cu's Y_* modes)
Y_HOST_SCALAR, Y_DEVICE_SCALAR, Y_ROWS, Y_COLUMNS = 1, 2, 3, 4

_F32_MAX = float(np.finfo(np.float32).max)
_EXACT_INT = 2**53  # Python ints up to this convert to float32 as CuPy converts them (through an exact double)
_ZERO = np.float32(0.0)
_INT32 = [np.int32(i) for i in range(16)]  # the op and mode codes, packed once
_FALSE, _TRUE = np.int32(0), np.int32(1)

_functions: dict[tuple[str, str, str, str], Any] = {}
_plans: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[bool, int, int] | None] = {}
_MAX_PLANS = 4096


def _kernel(kind: str, short: str, layout: str, vec: str) -> Any:
    """The RawKernel ``half_{kind}_{short}[_{layout}]_{vec}``, cached by those four names."""
    key = (kind, short, layout, vec)
    fn = _functions.get(key)
    if fn is None:
        fn = function(FAMILY, f"half_{kind}_{short}_{layout}_{vec}" if layout else f"half_{kind}_{short}_{vec}")
        _functions[key] = fn
    return fn


def host_scalar(value: Any) -> np.float32 | None:
    """A Python number as CuPy packs it for a float32 ufunc (rounded to float32), or None for one it would not
    convert exactly that way here: an int beyond 2**53, a finite float beyond float32's range."""
    t = type(value)
    if t is float:
        if -_F32_MAX <= value <= _F32_MAX or value != value or value in (math.inf, -math.inf):
            return np.float32(value)
        return None
    if t is int:
        return np.float32(value) if -_EXACT_INT <= value <= _EXACT_INT else None
    if t is bool:
        return np.float32(value)
    return None


def _operand_pattern(sx: tuple[int, ...], sy: tuple[int, ...]) -> tuple[int, int] | None:
    """(mode, m) of an operand of shape ``sy`` broadcast against one of shape ``sx`` whose shape is the
    result's: a scalar (one element), rows (sy is sx's trailing dims, with leading ones: y repeats every m
    elements) or columns (sy is sx's leading dims, with trailing ones: each y element repeats m times);
    None for any other pattern."""
    if len(sy) > len(sx):
        return None
    ny = 1
    for s in sy:
        ny *= s
    if ny == 1:
        return Y_DEVICE_SCALAR, 1
    padded = (1,) * (len(sx) - len(sy)) + sy
    first = next(i for i, s in enumerate(padded) if s != 1)
    if padded[first:] == sx[first:]:
        return Y_ROWS, ny
    end = max(i for i, s in enumerate(padded) if s != 1) + 1
    if padded[:end] == sx[:end]:
        m = 1
        for s in sx[end:]:
            m *= s
        return Y_COLUMNS, m
    return None


def broadcast_plan(sa: tuple[int, ...], sb: tuple[int, ...]) -> tuple[bool, int, int] | None:
    """(swap, mode, m) for operands of different shapes ``sa`` and ``sb``: the kernel's full operand x is b when
    swap (a otherwise) and the other one reaches it by ``mode`` (see :func:`_operand_pattern`); None where
    neither operand has the result's shape with the other in one of those patterns. Cached per pair of shapes."""
    key = (sa, sb)
    if key in _plans:
        return _plans[key]
    found = _operand_pattern(sa, sb)
    plan = (False, *found) if found is not None else None
    if plan is None:
        found = _operand_pattern(sb, sa)
        plan = (True, *found) if found is not None else None
    if len(_plans) < _MAX_PLANS:
        _plans[key] = plan
    return plan


def _aligned(ptr: int) -> bool:
    return ptr & 15 == 0


def _binary(code: int, compare: bool, a: Any, b: Any) -> Array | None:
    """``a op b`` (``code`` of ARITHMETIC, or of COMPARISONS when ``compare``) by one kernel, or None."""
    cp = _cp()
    nd = cp.ndarray
    if type(a) is nd:
        dt = a.dtype
        short = _SHORT.get(dt)
        if short is None:
            return None
        if type(b) is nd:
            if b.dtype is not dt and b.dtype != dt:
                return None
            sa, sb = a.shape, b.shape
            if sa == sb:
                if not (a.flags.c_contiguous and b.flags.c_contiguous):
                    return None
                out = cp.empty(sa, _BOOL if compare else dt)
                n = a.size
                if n:
                    vec = "v8" if _aligned(a.data.ptr | b.data.ptr | out.data.ptr) else "v1"
                    grid = _elementwise_grid(n >> 3 if vec == "v8" else (n + 3) >> 2)
                    _kernel("compare" if compare else "binary", short, "ff", vec)(
                        grid, _BLOCK, (a, b, out, np.int64(n), _INT32[code]))
                return out
            plan = broadcast_plan(sa, sb)
            if plan is None:
                return None
            swap, mode, m = plan
            x, y = (b, a) if swap else (a, b)
            if not x.flags.c_contiguous or (mode != Y_DEVICE_SCALAR and not y.flags.c_contiguous):
                return None
            return _broadcast(code, compare, short, x, y, mode, m, _ZERO, swap)
        ys = host_scalar(b)
        if ys is None or not a.flags.c_contiguous:
            return None
        return _broadcast(code, compare, short, a, None, Y_HOST_SCALAR, 1, ys, False)
    if type(b) is nd:
        short = _SHORT.get(b.dtype)
        ys = host_scalar(a)
        if short is None or ys is None or not b.flags.c_contiguous:
            return None
        return _broadcast(code, compare, short, b, None, Y_HOST_SCALAR, 1, ys, True)
    return None


def _broadcast(code: int, compare: bool, short: str, x: Any, y: Any, mode: int, m: int, ys: np.float32,
               swap: bool) -> Array:
    """op(x, y) (op(y, x) when swap) over x's elements, y reaching the kernel by ``mode``."""
    out = _cp().empty(x.shape, _BOOL if compare else x.dtype)
    n = x.size
    if n == 0:
        return out
    v8 = _aligned(x.data.ptr | out.data.ptr) and (
        mode <= Y_DEVICE_SCALAR or (m % 8 == 0 and (mode == Y_COLUMNS or _aligned(y.data.ptr))))
    vec = "v8" if v8 else "v1"
    grid = _elementwise_grid(n >> 3 if v8 else (n + 3) >> 2)
    yp = _NULL if y is None else y
    if compare:
        op = _MIRRORED[code] if swap else code  # exact for a bool: no operand order to keep
        _kernel("compare", short, "fb", vec)(
            grid, _BLOCK, (x, yp, out, np.int64(n), _INT32[mode], np.int64(m), ys, _INT32[op]))
    else:
        _kernel("binary", short, "fb", vec)(
            grid, _BLOCK, (x, yp, out, np.int64(n), _INT32[mode], np.int64(m), ys, _INT32[code],
                           _TRUE if swap else _FALSE))
    return out


def _unary(code: int, a: Any, p: np.float32 = _ZERO) -> Array | None:
    """``op(a)`` (``code`` of half_elementwise.cu's unary ops, ``p`` the exponent of pow) by one kernel, or None."""
    cp = _cp()
    if type(a) is not cp.ndarray:
        return None
    short = _SHORT.get(a.dtype)
    if short is None or not a.flags.c_contiguous:
        return None
    out = cp.empty(a.shape, a.dtype)
    n = a.size
    if n:
        v8 = _aligned(a.data.ptr | out.data.ptr)
        _kernel("unary", short, "", "v8" if v8 else "v1")(
            _elementwise_grid(n >> 3 if v8 else (n + 3) >> 2), _BLOCK, (a, out, np.int64(n), _INT32[code], p))
    return out


def _binary_op(op: str, compare: bool) -> Callable[[Any, Any], Array | None]:
    """The launcher of arithmetic ``op`` (``compare`` False) or comparison ``op`` (True, results bool)."""
    code = COMPARISONS[op] if compare else ARITHMETIC[op]

    def launch(a: Any, b: Any) -> Array | None:
        return _binary(code, compare, a, b)

    launch.__name__ = op
    result = "to bool" if compare else "(float32 math, one rounding)"
    launch.__doc__ = f"``{op}(a, b)`` of bfloat16/float16 operands {result} in one launch, or None."
    return launch


def _unary_op(op: str) -> Callable[[Any], Array | None]:
    code = UNARY[op]

    def launch(a: Any) -> Array | None:
        return _unary(code, a)

    launch.__name__ = op
    launch.__doc__ = f"``{op}(a)`` of a bfloat16/float16 array in one launch (float32 math, one rounding), or None."
    return launch


_pow_binary = _binary_op("pow", False)


def pow(a: Any, b: Any) -> Array | None:
    """``a ** b`` in one launch, or None. An array to a Python exponent takes CuPy's ``ndarray.__pow__`` paths
    (and NumPy's): ``** 2`` squares (``x * x``), ``** 0.5`` is sqrt, ``** -1.0`` the reciprocal, any other
    exponent powf; an array or 0-d exponent, or a Python base, powf."""
    if type(a) is _cp().ndarray:
        tb = type(b)
        if (tb is int and b == 2) or (tb is float and b == 2.0):
            return _unary(_SQUARE, a)
        if tb is float and b == 0.5:
            return _unary(_SQRT, a)
        if tb is float and b == -1.0:
            return _unary(_RECIPROCAL, a)
        if tb is int or tb is float or tb is bool:
            p = host_scalar(b)
            return None if p is None else _unary(_POW_SCALAR, a, p)
    return _pow_binary(a, b)


# op name -> launcher
LAUNCHERS: dict[str, Callable[..., Array | None]] = {
    **{op: pow if op == "pow" else _binary_op(op, False) for op in ARITHMETIC},
    **{op: _binary_op(op, True) for op in COMPARISONS},
    **{op: _unary_op(op) for op in UNARY},
}

# op name -> (launcher, dtype names it handles): this family's part of the package's KERNELS
KERNELS: Registry = {op: (fn, _HALF_NAMES) for op, fn in LAUNCHERS.items()}
