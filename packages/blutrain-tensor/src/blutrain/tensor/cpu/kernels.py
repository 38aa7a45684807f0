"""The built-in "cpu-kernels" plugin: registers every generic kernel for device "cpu".

float16 and bfloat16 math is computed in float32 and rounded once at the end, as PyTorch's CPU
kernels accumulate; data movement (copies, gathers, concatenation) runs in the storage dtype.
Kernels always hand back arrays (NumPy returns scalars from 0-d arithmetic; they are wrapped here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from blutrain.tensor.cpu import elementwise as ew
from blutrain.tensor.cpu import indexing as ix
from blutrain.tensor.cpu import linalg as la
from blutrain.tensor.cpu import nn
from blutrain.tensor.cpu import reduction as rd
from blutrain.tensor.dtype import (
    ALL_DTYPES,
    FLOAT_UNARY_OPS,
    FLOATING_DTYPES,
    HALF_NAMES,
    INTEGER_DTYPES,
    NUMERIC_DTYPES,
    DType,
    bool_,
    float32,
)
from blutrain.tensor.errors import TensorTypeError
from blutrain.tensor.half import HalfPrecision
from blutrain.tensor.kernel import KernelRegistry
from blutrain.tensor.plugins import hookimpl

Kernel = Callable[..., Any]
_ndarray = np.ndarray


def _fix(out: Any) -> Any:
    if type(out) is _ndarray:
        return out
    if isinstance(out, tuple):
        return tuple(_fix(o) for o in out)
    if out is None:
        return None
    return np.asarray(out)


def arrays_out(fn: Kernel) -> Kernel:
    """Wrap a kernel so that 0-d results are arrays, never NumPy scalars."""

    def kernel(*args: Any) -> Any:
        out = fn(*args)
        return out if type(out) is _ndarray else _fix(out)

    kernel.__name__ = fn.__name__
    kernel.__doc__ = fn.__doc__
    return kernel


def _is_host_array(value: Any) -> bool:
    return type(value) is _ndarray


def _astype(value: Any, dtype: np.dtype[Any]) -> Any:
    return value.astype(dtype)


# Half-precision math in float32; outputs that are not rounded back (kept statistics, non-float32 results)
# are still made arrays.
HALF_PRECISION = HalfPrecision(is_array=_is_host_array, cast=_astype, finish=_fix)


def _index_put_in_float32(a: Any, key: tuple[Any, ...], value: Any, accumulate: bool) -> None:
    """Accumulating into a half array one addend at a time would round after every addend; sum in
    float32 and round once. (Plain assignment needs no arithmetic and writes in place directly.)"""
    if not accumulate:
        ix.index_put(a, key, value, False)
        return
    wide = a.astype(np.float32)
    ix.index_put(wide, key, HALF_PRECISION.widen(value), True)
    a[...] = wide.astype(a.dtype)


# op → (kernel, dtypes, runs in float32 for half types)
TABLE: dict[str, tuple[Kernel, Iterable[DType], bool]] = {}


def _add(names: Iterable[str], module: Any, dtypes: Iterable[DType], math: bool = True) -> None:
    for name in names:
        TABLE[name] = (getattr(module, name), tuple(dtypes), math)


_add(("add", "mul", "maximum", "minimum"), ew, ALL_DTYPES)
_add(("sub", "pow", "floor_divide", "remainder"), ew, NUMERIC_DTYPES)
_add(("div",), ew, FLOATING_DTYPES)  # true division of integers runs in the default float dtype
_add(ew.COMPARISON, ew, ALL_DTYPES)
_add(ew.LOGICAL, ew, (bool_,), math=False)
_add(ew.BITWISE, ew, INTEGER_DTYPES, math=False)  # `&`, `|`, `^`, `~` on bool tensors are the logical ops
_add(("neg", "abs", "sign", "relu"), ew, NUMERIC_DTYPES)
_add((*FLOAT_UNARY_OPS, "gelu_backward"), ew, FLOATING_DTYPES)
_add(("where", "copy", "cast", "full", "eye"), ew, ALL_DTYPES, math=False)
_add(("arange", "linspace"), ew, NUMERIC_DTYPES, math=False)
_add(("clamp",), ew, NUMERIC_DTYPES)
_add(("sum", "amax", "amin", "max_dim", "min_dim", "argmax", "argmin"), rd, ALL_DTYPES)
_add(("mean", "var", "norm", "logsumexp", "softmax", "log_softmax", "softmax_backward",
      "log_softmax_backward"), rd, FLOATING_DTYPES)
_add(("all", "any"), rd, (bool_,), math=False)
_add(("matmul", "linear"), la, NUMERIC_DTYPES)
_add(("linear_gelu",), la, FLOATING_DTYPES)
_add(("linear_add",), la, FLOATING_DTYPES, math=False)  # half operands, float32 residual: one rounding, its own
_add(("linear_backward",), la, FLOATING_DTYPES, math=False)  # multiplies half operands in float32 itself (wide outputs)
_add(("index", "index_select", "gather", "tril", "triu", "cat", "embedding", "index_put"), ix, ALL_DTYPES,
     math=False)
_add(("scatter_add", "index_add"), ix, ALL_DTYPES)
_add(("embedding_backward",), ix, FLOATING_DTYPES, math=False)  # rounds half sums, product and addend sum itself
_add(("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "bias_gelu", "bias_gelu_backward",
      "dropout", "cross_entropy", "cross_entropy_backward", "sdpa", "sdpa_backward", "sdpa_packed",
      "sdpa_packed_backward", "rope", "rope_backward", "swiglu", "swiglu_backward"), nn, FLOATING_DTYPES)
_add(("linear_cross_entropy",), nn, FLOATING_DTYPES, math=False)  # handles half dtypes itself (float32 accumulation)

# outputs of forward kernels that are statistics for backward: kept in float32 for half inputs
STATISTICS: dict[str, tuple[int, ...]] = {"layer_norm": (1, 2), "rms_norm": (1, 2), "cross_entropy": (1,),
                                          "sdpa": (1,), "sdpa_packed": (1,)}


def kernel_for(op: str, dtype: DType) -> Kernel:
    """The CPU kernel of ``op`` for ``dtype``, wrapped as registered (used by the conformance suite)."""
    fn, dtypes, math = TABLE[op]
    if dtype not in dtypes:
        raise KeyError((op, dtype.name))
    if dtype.name in HALF_NAMES:
        if op == "index_put":
            return _index_put_in_float32
        if math:
            return HALF_PRECISION.in_float32(fn, dtype, STATISTICS.get(op, ()))
    return arrays_out(fn)


def scale_multi_tensor(arrays: list[Any], coef: Any) -> None:
    """Multiply every array of ``arrays`` in place by the 0-d ``coef`` (of their dtype): the global-norm
    clip's rescaling of every gradient. A multi-tensor kernel, like the optimizers' (outside the catalogue of
    tensor ops): one call for all gradients, which a backend may run as one launch."""
    for a in arrays:
        np.multiply(a, coef, out=a)


def norm_multi_tensor(arrays: list[Any]) -> Any:
    """The 2-norm of all elements of ``arrays`` together (one dtype), as a 0-d array: float64 for float64
    arrays, else float32. The global-norm clip's norm in one call (a backend may run it as two launches
    over all gradients) instead of a copy of every gradient laid end to end and a norm of that."""
    dt = arrays[0].dtype
    total = 0.0
    for a in arrays:
        flat = np.ravel(a).astype(np.float64)
        total += float(np.dot(flat, flat))
    return np.asarray(np.sqrt(total), np.float64 if dt == np.float64 else np.float32)


def cast_multi_tensor(arrays: list[Any], dtype: Any) -> list[Any]:
    """Each array of ``arrays`` (one dtype) converted to ``dtype``, as the ``cast`` kernel converts it: a new
    array each, in a list. A multi-tensor kernel (outside the catalogue of tensor ops): the compiler's
    ``multi-tensor-cast`` pass gives it a step's casts of parameters to one dtype (autocast's bf16 copies of
    the weights), which a backend may run as one launch."""
    for i, a in enumerate(arrays):
        if a.dtype != arrays[0].dtype:  # as the cuda kernel, which takes one source dtype per launch
            raise TensorTypeError(f"cast_multi_tensor: array {i} has dtype {a.dtype}, array 0 {arrays[0].dtype}; "
                                  "expected one dtype")
    return [a.astype(dtype) for a in arrays]


@hookimpl
def blutrain_register_kernels(registry: KernelRegistry) -> None:
    for op, (_, dtypes, _) in TABLE.items():
        for dt in dtypes:
            registry.register(op, "cpu", dt, kernel_for(op, dt))
    for dt in FLOATING_DTYPES:
        registry.register("scale_multi_tensor", "cpu", dt, scale_multi_tensor)
        registry.register("norm_multi_tensor", "cpu", dt, norm_multi_tensor)
    for dt in ALL_DTYPES:  # the dtypes of the cast kernel
        registry.register("cast_multi_tensor", "cpu", dt, cast_multi_tensor)


__all__ = ["TABLE", "cast_multi_tensor", "float32", "kernel_for", "norm_multi_tensor", "scale_multi_tensor"]
