"""CUDA codegen: a ``blutrain.fused`` region becomes one CUDA elementwise kernel (CuPy's
``ElementwiseKernel``, compiled by NVRTC), cached by the hash of the region's IR.

The kernel reads each input once (broadcast by CuPy's indexing), keeps every intermediate in
registers and writes only the region's results: n ops cost one launch and one pass over memory.
Arithmetic is in the region's dtype (``float`` or ``double``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from blutrain.compiler.dialect import FusedOp, Operand, YieldOp, decode, kernel_name, type_info
from blutrain.compiler.errors import CompilerError

_BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
           "pow": "pow({0}, {1})", "maximum": "max({0}, {1})", "minimum": "min({0}, {1})"}
_UNARY = {"neg": "(-{0})", "exp": "exp({0})", "log": "log({0})", "sqrt": "sqrt({0})", "tanh": "tanh({0})",
          "abs": "abs({0})"}
_CTYPE = {"float32": "float", "float64": "double"}
_cache: dict[str, Any] = {}


def kernel_source(op: FusedOp) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the region's ``ElementwiseKernel``."""
    block = op.body.block
    dtype = type_info(op.results[0].type)[1].name
    ctype = _CTYPE.get(dtype)
    if ctype is None:
        raise CompilerError(f"cuda codegen: fused regions compute in float32 or float64, not {dtype}")
    names: dict[Any, str] = {a: f"in{i}" for i, a in enumerate(block.args)}
    body: list[str] = []
    consts: list[str] = []
    members = [m for m in block.ops if not isinstance(m, YieldOp)]
    yielded = next(m for m in block.ops if isinstance(m, YieldOp)).operands
    for i, m in enumerate(members):
        args = []
        for a in decode(m.properties["args"]):
            if isinstance(a, Operand):
                args.append(names[m.operands[a.index]])
            else:  # scalars are kernel parameters, so that a changed value needs no new kernel
                consts.append(f"{ctype} c{len(consts)}")
                args.append(f"c{len(consts) - 1}")
        n = kernel_name(m)
        form = _BINARY.get(n) or _UNARY.get(n)
        if form is None:
            raise CompilerError(f"cuda codegen: no code for {n!r} in a fused region")
        body.append(f"{ctype} v{i} = {form.format(*args)};")
        names[m.results[0]] = f"v{i}"
    body.extend(f"out{j} = {names[v]};" for j, v in enumerate(yielded))
    # parameter types are NumPy names for CuPy ("float" there means Python's float: float64)
    ins = ", ".join([*(c.replace(ctype, dtype, 1) for c in consts),
                     *(f"{type_info(a.type)[1].name} in{i}" for i, a in enumerate(block.args))])
    outs = ", ".join(f"{dtype} out{j}" for j in range(len(yielded)))
    key = hashlib.sha256(str(op).encode()).hexdigest()[:16]
    return ins, outs, " ".join(body), f"blutrain_fused_{key}"


def compile_region(op: FusedOp) -> Callable[..., Any]:
    """The region as ``fn(consts, *inputs) -> tuple`` on CuPy arrays (compiled once per distinct region)."""
    import cupy

    ins, outs, operation, name = kernel_source(op)
    kernel = _cache.get(name)
    if kernel is None:
        kernel = _cache[name] = cupy.ElementwiseKernel(ins, outs, operation, name)
    shapes = [type_info(r.type) for r in op.results]

    def fn(consts: list[Any], *inputs: Any) -> Any:
        results = tuple(cupy.empty(shape, dtype=dt.np) for shape, dt in shapes)
        kernel(*consts, *inputs, *results)
        return results

    return fn


class CudaTarget:
    """The "codegen-cuda" target: fused regions as CUDA elementwise kernels."""

    name = "codegen-cuda"
    device = "cuda"

    def compile_region(self, op: FusedOp) -> Callable[..., Any]:
        return compile_region(op)


TARGET = CudaTarget()

__all__ = ["TARGET", "CudaTarget", "compile_region", "kernel_source"]
