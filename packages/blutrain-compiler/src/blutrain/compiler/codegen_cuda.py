"""CUDA codegen: a ``blutrain.fused`` region becomes the source of one CUDA elementwise kernel in the form of
CuPy's ``ElementwiseKernel`` (:func:`kernel_spec`), named by the hash of the region's IR. The compiler imports
no device library: the CUDA backend plugin's compile target compiles it (NVRTC) and launches it.

The kernel reads each input once (broadcast by CuPy's indexing), keeps every intermediate in
registers and writes only the region's results: n ops cost one launch and one pass over memory.

Each member computes as its eager kernel does, so a region is bit-identical to its ops run one by
one: float32 members in ``float``, float64 members in ``double``, float16/bfloat16 members in
``float`` from their widened operands, their result rounded to the half dtype once (the CUDA
backend's half-precision kernels: widen, compute in float32, round). Additions, subtractions,
products and quotients are the ``__fadd_rn``-style intrinsics, which the compiler never contracts
into an FMA with a neighbouring member (separate kernels round each result); functions are the ones
CuPy's ufuncs call (``expf``, ``powf``, NaN-propagating ``maximum``), and a power with a scalar exponent
takes the fast paths CuPy's ``**`` takes (``x * x`` for ``** 2``, chosen per call from the exponent).

Half-precision arrays go to the kernel as ``uint16`` views and come back as ``uint16`` arrays viewed
as their dtype, so nothing depends on CuPy knowing bfloat16; the generated C converts with the bit
operations of BluTrain's cast kernels (``blutrain/kernels/cuda/casts.cu``), NaN rules included:
round to nearest even, subnormals kept, overflow to inf. CuPy compiles its ufuncs and these kernels
alike with ``-ftz=true``: float arithmetic and float64 → float32 conversions flush float32 subnormals
here as in the eager kernels, and the bit conversions keep them as the eager cast kernels do. Casts to
or from float64 follow NumPy's NaN rules; the eager one (CuPy's ``astype``) may give another NaN of
the same sign.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.ir import SSAValue

from blutrain.compiler.dialect import FusedOp, Operand, YieldOp, decode, kernel_name, type_info
from blutrain.compiler.errors import CompilerError
from blutrain.compiler.passes.fusion import compute_dtype, dtype_name, is_scalar_arg
from blutrain.tensor.dtype import FLOATING_NAMES, HALF_NAMES, DType

# NaN as CuPy's maximum/minimum define it, then the conversions between float32 and the 16-bit dtypes, bit
# for bit as NumPy/ml_dtypes (and the eager cast kernels of casts.cu) convert; 16-bit values are their bits.
PREAMBLE = r"""
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

__device__ __forceinline__ bool bt_f32_isnan(unsigned int u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// bfloat16 -> float32 is exact: the bits are float32's upper half.
__device__ __forceinline__ float bt_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// float32 -> bfloat16, round to nearest even on the upper 16 bits (adding 0x7fff plus the kept lsb carries a
// tie to the even neighbour and the largest finite values to inf); a NaN becomes the quiet NaN of its sign.
__device__ __forceinline__ unsigned short bt_f32_to_bf16(float x) {
    const unsigned int u = __float_as_uint(x);
    if (bt_f32_isnan(u)) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float16 -> float32 is exact; a NaN is widened bit for bit (sign and payload), as NumPy does.
__device__ __forceinline__ float bt_f16_to_f32(unsigned short h) {
    if ((h & 0x7fffu) > 0x7c00u) {
        return __uint_as_float(((unsigned int)(h & 0x8000u) << 16) | 0x7f800000u | ((unsigned int)(h & 0x3ffu) << 13));
    }
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// float32 -> float16 by the hardware's round to nearest even (subnormals kept); a NaN keeps its sign and the
// top 10 bits of its payload, made nonzero (NumPy's rule).
__device__ __forceinline__ unsigned short bt_f32_to_f16(float x) {
    const unsigned int u = __float_as_uint(x);
    if (bt_f32_isnan(u)) {
        const unsigned int m = (u & 0x7fffffu) >> 13;
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7c00u | (m ? m : 1u));
    }
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// float64 -> float16 in one rounding, as NumPy converts (the NaN rule as above, from the double's payload).
__device__ __forceinline__ unsigned short bt_f64_to_f16(double x) {
    const unsigned long long u = (unsigned long long)__double_as_longlong(x);
    if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
        const unsigned int m = (unsigned int)((u & 0xfffffffffffffull) >> 42);
        return (unsigned short)((unsigned int)((u >> 48) & 0x8000u) | 0x7c00u | (m ? m : 1u));
    }
    unsigned short h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(x));
    return h;
}

// bfloat16 <-> float16 go through float32 (exact), as ml_dtypes converts; bfloat16's NaN becomes float16's
// quiet NaN of its sign.
__device__ __forceinline__ unsigned short bt_bf16_to_f16(unsigned short b) {
    if ((b & 0x7fffu) > 0x7f80u) return (unsigned short)((b & 0x8000u) | 0x7e00u);
    return bt_f32_to_f16(bt_bf16_to_f32(b));
}
__device__ __forceinline__ unsigned short bt_f16_to_bf16(unsigned short h) { return bt_f32_to_bf16(bt_f16_to_f32(h)); }

// x ** c for a scalar exponent as CuPy's ndarray.__pow__ computes it: the fast path p that the host chose from
// the Python scalar (1: x * x, 2: sqrt, 3: 1 / x, as NumPy's), else the power ufunc's powf/pow.
__device__ __forceinline__ float bt_pow_scalar(float x, float c, int p) {
    return p == 1 ? __fmul_rn(x, x) : p == 2 ? sqrtf(x) : p == 3 ? __fdiv_rn(1.0f, x) : powf(x, c);
}
__device__ __forceinline__ double bt_pow_scalar(double x, double c, int p) {
    return p == 1 ? __dmul_rn(x, x) : p == 2 ? sqrt(x) : p == 3 ? __ddiv_rn(1.0, x) : pow(x, c);
}
"""

# a float exponent -> the fast path of ``array ** exponent`` (bt_pow_scalar's p); an int exponent has one, 2
POW_FAST_PATHS = {2.0: 1, 0.5: 2, -1.0: 3}


def pow_fast_path(exponent: Any) -> int:
    """The fast path CuPy's ``array ** exponent`` takes for a scalar exponent, 0 for none (its ``power``). Seen
    on CuPy 14: ``** 2`` and ``** 2.0`` are ``x * x``, ``** 0.5`` is ``sqrt``, ``** -1.0`` is ``1 / x``, but
    ``** -1`` is ``power``."""
    if isinstance(exponent, (float, np.floating)):
        return POW_FAST_PATHS.get(float(exponent), 0)
    return 1 if exponent == 2 else 0


# how a value of each dtype is held in the kernel, and the CuPy parameter type of its arrays
_STORAGE = {"float16": "unsigned short", "bfloat16": "unsigned short", "float32": "float", "float64": "double"}
_PARAM = {"float16": "uint16", "bfloat16": "uint16", "float32": "float32", "float64": "float64"}
_WIDEN = {"float16": "bt_f16_to_f32({0})", "bfloat16": "bt_bf16_to_f32({0})", "float32": "{0}", "float64": "{0}"}
# (source, target) -> the conversion of a held value; float64 -> bfloat16 goes through float32 as ml_dtypes and
# CuPy convert it
_CAST = {
    ("float32", "bfloat16"): "bt_f32_to_bf16({0})", ("bfloat16", "float32"): "bt_bf16_to_f32({0})",
    ("float32", "float16"): "bt_f32_to_f16({0})", ("float16", "float32"): "bt_f16_to_f32({0})",
    ("bfloat16", "float16"): "bt_bf16_to_f16({0})", ("float16", "bfloat16"): "bt_f16_to_bf16({0})",
    ("float32", "float64"): "((double){0})", ("float64", "float32"): "((float){0})",
    ("bfloat16", "float64"): "((double)bt_bf16_to_f32({0}))", ("float16", "float64"): "((double)bt_f16_to_f32({0}))",
    ("float64", "bfloat16"): "bt_f32_to_bf16((float){0})", ("float64", "float16"): "bt_f64_to_f16({0})",
}
# member forms per compute type, as CuPy's ufuncs compute them ({0}, {1}: operands in that type)
_FORMS: dict[str, dict[str, str]] = {
    "float": {"add": "__fadd_rn({0}, {1})", "sub": "__fsub_rn({0}, {1})", "mul": "__fmul_rn({0}, {1})",
              "div": "__fdiv_rn({0}, {1})", "pow": "powf({0}, {1})",
              "maximum": "((isnan({0}) | isnan({1})) ? NAN : max({0}, {1}))",
              "minimum": "((isnan({0}) | isnan({1})) ? NAN : min({0}, {1}))",
              "neg": "(-{0})", "exp": "expf({0})", "log": "logf({0})", "sqrt": "sqrtf({0})", "tanh": "tanhf({0})",
              "abs": "fabsf({0})"},
    "double": {"add": "__dadd_rn({0}, {1})", "sub": "__dsub_rn({0}, {1})", "mul": "__dmul_rn({0}, {1})",
               "div": "__ddiv_rn({0}, {1})", "pow": "pow({0}, {1})",
               "maximum": "((isnan({0}) | isnan({1})) ? (double)NAN : max({0}, {1}))",
               "minimum": "((isnan({0}) | isnan({1})) ? (double)NAN : min({0}, {1}))",
               "neg": "(-{0})", "exp": "exp({0})", "log": "log({0})", "sqrt": "sqrt({0})", "tanh": "tanh({0})",
               "abs": "fabs({0})"},
}

def _generate(op: FusedOp) -> tuple[str, str, str, str, list[int]]:
    """:func:`kernel_source`, and the indices of the constants that are scalar exponents (each has a fast-path
    parameter ``int32 p<index>`` after the constants)."""
    block = op.body.block
    for v in (*block.args, *op.results):
        if dtype_name(v) not in FLOATING_NAMES:
            raise CompilerError(f"cuda codegen: fused regions hold float16, bfloat16, float32 and float64 values, "
                                f"not {dtype_name(v)}")
    names: dict[SSAValue, str] = {a: f"in{i}" for i, a in enumerate(block.args)}
    body: list[str] = []
    consts: list[str] = []
    exponents: list[int] = []
    members = [m for m in block.ops if not isinstance(m, YieldOp)]
    yielded = next(m for m in block.ops if isinstance(m, YieldOp)).operands
    for i, m in enumerate(members):
        n = kernel_name(m)
        rdt = dtype_name(m.results[0])
        if n == "cast":
            src = m.operands[0]
            form = "{0}" if dtype_name(src) == rdt else _CAST[(dtype_name(src), rdt)]
            expr = form.format(names[src])
        else:
            ctype = "double" if compute_dtype(m) == "float64" else "float"
            form = _FORMS[ctype].get(n, "")
            if not form:
                raise CompilerError(f"cuda codegen: no code for {n!r} in a fused region")
            template = decode(m.properties["args"])
            args = []
            for a in template:
                if isinstance(a, Operand):
                    v = m.operands[a.index]
                    args.append(_WIDEN[dtype_name(v)].format(names[v]))
                elif is_scalar_arg(a):  # scalars are kernel parameters, so that a changed value needs no new kernel
                    consts.append(f"{compute_dtype(m)} c{len(consts)}")
                    args.append(f"c{len(consts) - 1}")
                else:
                    raise CompilerError(f"cuda codegen: {n!r} has an argument {a!r} that is not a number")
            if n == "pow" and isinstance(template[0], Operand) and not isinstance(template[1], Operand):
                exponents.append(len(consts) - 1)
                form = f"bt_pow_scalar({{0}}, {{1}}, p{len(consts) - 1})"
            expr = form.format(*args)
            if rdt in HALF_NAMES:  # rounded once, as the eager half-precision kernels round their float32 result
                expr = _CAST[("float32", rdt)].format(expr)
        body.append(f"{_STORAGE[rdt]} v{i} = {expr};")
        names[m.results[0]] = f"v{i}"
    body.extend(f"out{j} = {names[v]};" for j, v in enumerate(yielded))
    # parameter types are NumPy names for CuPy ("float" there means Python's float: float64)
    ins = ", ".join([*consts, *(f"int32 p{k}" for k in exponents),
                     *(f"{_PARAM[dtype_name(a)]} in{i}" for i, a in enumerate(block.args))])
    outs = ", ".join(f"{_PARAM[dtype_name(v)]} out{j}" for j, v in enumerate(yielded))
    key = hashlib.sha256(str(op).encode()).hexdigest()[:16]
    return ins, outs, "\n".join(body), f"blutrain_fused_{key}", exponents


def kernel_source(op: FusedOp) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the region's ``ElementwiseKernel`` (with :data:`PREAMBLE`)."""
    return _generate(op)[:4]


@dataclass(frozen=True)
class KernelSpec:
    """Everything a CUDA backend needs to compile and launch a region as one ``ElementwiseKernel``.

    The kernel takes, in order: the region's scalar constants; an ``int32`` fast-path code
    (:func:`pow_fast_path`) for each constant at an index in ``exponents``, chosen per call from that call's
    value; the inputs (half-precision ones, marked in ``half_inputs``, as ``uint16`` views); then the results,
    allocated by the caller with the shapes and dtypes in ``results`` (half-precision ones as ``uint16``,
    viewed back as their dtype)."""

    in_params: str
    out_params: str
    operation: str
    name: str  # unique per distinct region: a cache key
    exponents: tuple[int, ...]
    half_inputs: tuple[bool, ...]
    results: tuple[tuple[tuple[int, ...], DType], ...]


def kernel_spec(op: FusedOp) -> KernelSpec:
    """The region ``op`` as a :class:`KernelSpec` (its source with :data:`PREAMBLE`, and how to call it)."""
    ins, outs, operation, name, exponents = _generate(op)
    return KernelSpec(ins, outs, operation, name, tuple(exponents),
                      tuple(dtype_name(a) in HALF_NAMES for a in op.body.block.args),
                      tuple(type_info(r.type) for r in op.results))


__all__ = ["POW_FAST_PATHS", "PREAMBLE", "KernelSpec", "kernel_source", "kernel_spec", "pow_fast_path"]
