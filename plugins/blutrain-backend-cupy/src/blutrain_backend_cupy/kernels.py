"""Kernel registration for device "cuda".

Three layers, highest priority last:

* every op of the CPU plugin's TABLE with its generic kernel (they take the array module from their
  inputs, so they run on CuPy unchanged), except the few that are NumPy-only: factories (they call
  ``np.full``...), ``add.at`` scatters (CuPy's supports few dtypes), ``clamp`` (one-sided bounds);
  float16/bfloat16 math computed in float32 and rounded once, as on the CPU;
* GEMM ops through cuBLAS (:mod:`blutrain_backend_cupy.gemm`);
* the fused kernels of :mod:`blutrain.kernels.cuda` at priority 10, each falling back to the layer
  below for a call it does not cover (the float32/bfloat16/float16 casts among them, which the
  half-precision wrappers below use as well; and the bfloat16/float16 elementwise ops, one launch each
  with the bits of the wrapped generic op, for contiguous operands with simple broadcasts).

Without a GPU every op is registered as a function raising :class:`CudaUnavailableError`, so that
using the device says why it cannot run instead of "no kernel".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.kernels import cuda as fused
from blutrain.tensor.cpu import STATISTICS, TABLE, check_embedding_addend
from blutrain.tensor.dtype import ALL_DTYPES, HALF_NAMES, DType, as_dtype
from blutrain.tensor.half import HalfPrecision
from blutrain.tensor.kernel import KernelRegistry
from blutrain_backend_cupy import gemm
from blutrain_backend_cupy.backend import unavailable_error

Kernel = Callable[..., Any]
Array = Any
DEVICE = "cuda"
FUSED_PRIORITY = 10
# Ops whose half-precision inputs go to the kernel as they are: cuBLAS multiplies bf16/fp16
# with float32 accumulation; index_put writes in the storage dtype (as on the CPU).
NATIVE_HALF = frozenset({"matmul", "linear", "linear_gelu", "linear_backward", "index_put"})


def _cp() -> Any:
    import cupy

    return cupy


# ---------------------------------------------------------------------------------------------- half precision

def _is_device_array(value: Any) -> bool:
    """A value with a dtype that is not a host (NumPy) array: a CuPy array, or a NumPy scalar."""
    return type(value) is not np.ndarray and getattr(value, "dtype", None) is not None


# float16/bfloat16 math in float32 as on the CPU; casts by the cast kernels (the CPU backend's bits).
HALF_PRECISION = HalfPrecision(is_array=_is_device_array, cast=gemm.astype_by_kernel)


# ---------------------------------------------------------------------------------------------- NumPy-only ops


def _via_float32(dtype: Any) -> bool:
    return np.dtype(dtype).name in HALF_NAMES


def full(shape: tuple[int, ...], value: float, dtype: Any) -> Array:
    cp = _cp()
    if _via_float32(dtype):
        return cp.full(shape, value, dtype=np.float32).astype(dtype)
    return cp.full(shape, value, dtype=dtype)


def arange(start: float, end: float, step: float, dtype: Any) -> Array:
    cp = _cp()
    # ml_dtypes' bfloat16 has kind 'V', not 'f': test the name too
    wide = np.float64 if np.dtype(dtype).kind == "f" or np.dtype(dtype).name in HALF_NAMES else np.int64
    return cp.arange(start, end, step, dtype=wide).astype(dtype)


def linspace(start: float, end: float, steps: int, dtype: Any) -> Array:
    if np.dtype(dtype).kind in "iub":
        # Truncation to integers magnifies the last bit: CuPy's float64 points can land a hair below an
        # integer that NumPy's (the CPU kernel's) hit exactly, so integer points are made as NumPy makes them.
        return _cp().asarray(np.linspace(start, end, steps, dtype=np.float64).astype(dtype))
    return _cp().linspace(start, end, steps, dtype=np.float64).astype(dtype)


def eye(n: int, m: int, dtype: Any) -> Array:
    cp = _cp()
    if _via_float32(dtype):
        return cp.eye(n, m, dtype=np.float32).astype(dtype)
    return cp.eye(n, m, dtype=dtype)


def clamp(a: Array, lo: float | None, hi: float | None) -> Array:
    cp = _cp()
    out = a
    if lo is not None:
        out = cp.maximum(out, lo)
    if hi is not None:
        out = cp.minimum(out, hi)
    return out.copy() if out is a else out


# CuPy's scatter-add (ufunc.at) covers these dtypes natively.
_NATIVE_ADD_AT = frozenset({"float32", "float64", "int32", "uint32", "uint64"})


def add_at(out: Array, key: Any, values: Any) -> None:
    """``out[key] += values`` in place, summing repeated indices, for every dtype: half floats in
    float32, other integers and bool through 64-bit two's-complement sums, which wrap exactly as the
    narrow type would (and make any nonzero bool sum True, as NumPy's add.at)."""
    cp = _cp()
    name = out.dtype.name
    if name in _NATIVE_ADD_AT:
        cp.add.at(out, key, cp.asarray(values).astype(out.dtype, copy=False))
    elif name in HALF_NAMES:
        tmp = out.astype(np.float32)
        cp.add.at(tmp, key, cp.asarray(values).astype(np.float32))
        out[...] = tmp.astype(out.dtype)
    else:
        tmp = out.astype(np.int64).view(np.uint64)
        cp.add.at(tmp, key, cp.asarray(values).astype(np.int64).view(np.uint64))
        out[...] = tmp.view(np.int64).astype(out.dtype)


def cat(arrays: list[Array], dim: int) -> Array:
    """``concatenate``; while the stream is being captured into a CUDA graph, one device copy per piece:
    CuPy's concatenate of many arrays uploads their pointers from the host, which capture forbids."""
    cp = _cp()
    if not cp.cuda.runtime.streamIsCapturing(cp.cuda.get_current_stream().ptr):
        return cp.concatenate(arrays, axis=dim)
    axis = dim % arrays[0].ndim
    shape = list(arrays[0].shape)
    shape[axis] = sum(int(a.shape[axis]) for a in arrays)
    out = cp.empty(tuple(shape), cp.result_type(*arrays))
    start = 0
    for a in arrays:
        stop = start + int(a.shape[axis])
        out[(slice(None),) * axis + (slice(start, stop),)] = a
        start = stop
    return out


def index_put(a: Array, key: tuple[Any, ...], value: Any, accumulate: bool) -> None:
    if accumulate:
        add_at(a, key, value)
    else:
        a[key] = value


def _scatter_index(idx: Array, dim: int) -> tuple[Array, ...]:
    cp = _cp()
    grids: list[Array] = []
    for i, s in enumerate(idx.shape):
        shape = [1] * idx.ndim
        shape[i] = s
        grids.append(cp.arange(s).reshape(shape))
    grids[dim] = idx
    return tuple(grids)


def scatter_add(a: Array, dim: int, idx: Array, src: Array) -> Array:
    out = a.copy()
    add_at(out, _scatter_index(idx, dim), src)
    return out


def index_add(a: Array, dim: int, idx: Array, src: Array) -> Array:
    out = a.copy()
    add_at(out, (slice(None),) * dim + (idx,), src)
    return out


def embedding_backward(grad: Array, idx: Array, num_embeddings: int, addend: Array | None = None,
                       addend_scale: Array | None = None) -> Array:
    """Generic (any float dtype) embedding gradient by scatter-add; the fused kernel covers f32/bf16. With
    ``addend`` (and a 0-d ``addend_scale``): ``addend * addend_scale + sums``, the product, the sums and the
    add each rounded to grad's dtype as the separate ops round them (half dtypes through float32), as the
    CPU kernel computes it."""
    cp = _cp()
    check_embedding_addend(grad, num_embeddings, addend, addend_scale)
    dim = grad.shape[-1]
    out = cp.zeros((num_embeddings, dim), dtype=grad.dtype)
    if idx.size:
        add_at(out, idx.reshape(-1), grad.reshape(idx.size, dim))
    if addend is None:
        return out
    half = out.dtype.name in HALF_NAMES
    term = addend
    if addend_scale is not None:
        term = cp.multiply(HALF_PRECISION.widen(addend), HALF_PRECISION.widen(addend_scale))
        term = HALF_PRECISION.narrow(term, out.dtype) if half else term
    total = cp.add(HALF_PRECISION.widen(term), HALF_PRECISION.widen(out))
    return HALF_PRECISION.narrow(total, out.dtype) if half else total


OVERRIDES: dict[str, Kernel] = {
    "full": full,
    "arange": arange,
    "linspace": linspace,
    "eye": eye,
    "clamp": clamp,
    "index_put": index_put,
    "cat": cat,
    "scatter_add": scatter_add,
    "index_add": index_add,
    "embedding_backward": embedding_backward,
    "matmul": gemm.matmul,
    "linear": gemm.linear,
    "linear_add": gemm.linear_add,
    "linear_gelu": gemm.linear_gelu,
    "linear_backward": gemm.linear_backward,
    "linear_cross_entropy": gemm.linear_cross_entropy,
}


# ---------------------------------------------------------------------------------------------- registration


def generic_kernel(op: str, dtype: DType) -> Kernel:
    """The cuda kernel of ``op`` for ``dtype`` below the fused layer (also the fused layer's fallback)."""
    fn, dtypes, math = TABLE[op]
    if dtype not in tuple(dtypes):
        raise KeyError((op, dtype.name))
    base = OVERRIDES.get(op, fn)
    if math and dtype.name in HALF_NAMES and op not in NATIVE_HALF:
        return HALF_PRECISION.in_float32(base, dtype, STATISTICS.get(op, ()))
    return base


def prefer(fast: Kernel, fallback: Kernel) -> Kernel:
    """``fast`` where it covers the call (it returns None where it does not), else ``fallback``."""

    def kernel(*args: Any) -> Any:
        out = fast(*args)
        return fallback(*args) if out is None else out

    kernel.__name__ = getattr(fast, "__name__", "kernel")
    kernel.__doc__ = fast.__doc__
    return kernel


def _unavailable(op: str) -> Kernel:
    def kernel(*args: Any) -> Any:
        raise unavailable_error()

    kernel.__name__ = f"{op}_unavailable"
    return kernel


def register(registry: KernelRegistry, available: bool) -> None:
    if not available:
        for op, (_, dtypes, _) in TABLE.items():
            registry.register(op, DEVICE, tuple(dtypes), _unavailable(op))
        for op in fused.STANDALONE:
            registry.register(op, DEVICE, ALL_DTYPES, _unavailable(op))
        return
    # the environment's choice, where it makes one; else what set_tf32/set_fp32_gemm chose before the
    # registry loaded (lazily, at the first op) stays
    tf32, fp32 = gemm.tf32_requested_by_env(), gemm.fp32_gemm_requested_by_env()
    if tf32 is not None:
        gemm.set_tf32(tf32)
    if fp32 is not None:
        gemm.set_fp32_gemm(fp32)
    carveout = gemm.gemm_sm_carveout_requested_by_env()
    if carveout is not None:
        gemm.set_gemm_sm_carveout(carveout)
    for op, (_, dtypes, _) in TABLE.items():
        for dt in dtypes:
            registry.register(op, DEVICE, dt, generic_kernel(op, dt))
    for op, (fn, names) in fused.KERNELS.items():
        for name in names:
            dt = as_dtype(name)
            if op in TABLE and dt in tuple(TABLE[op][1]):  # a fused kernel always has a generic fallback
                registry.register(op, DEVICE, dt, prefer(fn, generic_kernel(op, dt)), priority=FUSED_PRIORITY)
    for op, (fn, names) in fused.STANDALONE.items():
        registry.register(op, DEVICE, tuple(names), fn, priority=FUSED_PRIORITY)
