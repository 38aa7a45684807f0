"""NumPy codegen for the CPU target: a ``blutrain.fused`` region becomes one generated Python function.

The function computes the region's ops as the CPU kernels compute them, so results are bit-identical
to eager mode: float32/float64 members with the same ufuncs (``pow`` as ``a ** b``); float16/bfloat16
members widen their operands to float32 (``astype``), apply the ufunc and round the result back with
``astype``, as the CPU backend's half-precision wrapper does; a cast is ``astype``. Every
float32/float64 result after the first goes into a temporary of the iteration shape that is dead by
then (``out=``), so a chain of n ops allocates one array instead of n (a half member's rounded result,
a cast's and a power's are new arrays). Functions are cached by the hash of the region's IR text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from xdsl.ir import Operation, SSAValue

from blutrain.compiler.dialect import FusedOp, Operand, YieldOp, decode, kernel_name, type_info
from blutrain.compiler.errors import CompilerError
from blutrain.compiler.passes.fusion import compute_dtype, dtype_name, is_scalar_arg
from blutrain.tensor.dtype import FLOATING_NAMES, HALF_NAMES, as_dtype

if TYPE_CHECKING:
    from blutrain.compiler.executor import CPUExecutor, Program

UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "pow": "power",
          "maximum": "maximum", "minimum": "minimum", "neg": "negative", "exp": "exp", "log": "log",
          "sqrt": "sqrt", "tanh": "tanh", "abs": "abs"}
# the NumPy dtypes the generated code names (``DT["bfloat16"]`` is ml_dtypes' bfloat16)
DTYPES: dict[str, np.dtype[Any]] = {name: as_dtype(name).np for name in FLOATING_NAMES}

_cache: dict[str, Callable[..., Any]] = {}


def region_key(op: FusedOp) -> str:
    return hashlib.sha256(str(op).encode()).hexdigest()


def _reads(m: Operation) -> list[tuple[str, SSAValue]]:
    """The arrays member ``m`` reads: ("s", v) is value v as stored, ("w", v) a half value widened to float32."""
    kind = "w" if kernel_name(m) != "cast" and dtype_name(m.results[0]) in HALF_NAMES else "s"
    return [(kind, v) for v in m.operands]


def source(op: FusedOp, name: str = "fused") -> str:
    """The Python source of the region's function ``name(xp, consts, *inputs) -> tuple of outputs``
    (``consts``: the members' scalar arguments, in order, as :func:`region_consts` lists them)."""
    block = op.body.block
    members = [m for m in block.ops if not isinstance(m, YieldOp)]
    yielded = set(next(m for m in block.ops if isinstance(m, YieldOp)).operands)
    shape = type_info(op.results[0].type)[0]  # the iteration shape
    names: dict[tuple[str, SSAValue], str] = {("s", a): f"in{i}" for i, a in enumerate(block.args)}
    last_read: dict[tuple[str, SSAValue], int] = {}
    for i, m in enumerate(members):
        for key in _reads(m):
            last_read[key] = i
    temps: dict[str, str] = {}  # arrays of the iteration shape made here → their dtype (float32/float64)
    free: dict[str, list[str]] = {}  # dtype → dead temporaries, free for the next result of that dtype
    lines = [f"def {name}(xp, consts, {', '.join(f'in{i}' for i in range(len(block.args)))}):",
             "    with xp.errstate(all='ignore'):"]
    n_const = 0
    n_arrays = 0

    def fresh() -> str:
        nonlocal n_arrays
        n_arrays += 1
        return f"t{n_arrays - 1}"

    for i, m in enumerate(members):
        op_name = kernel_name(m)
        result = m.results[0]
        rdt = dtype_name(result)
        reads = _reads(m)
        for kind, v in reads:  # widen each half operand once (the CPU kernels' ``astype(float32)``)
            if kind == "w" and (kind, v) not in names:
                w = names[(kind, v)] = fresh()
                lines.append(f"        {w} = {names[('s', v)]}.astype(DT['float32'])")
                if type_info(v.type)[0] == shape:
                    temps[w] = "float32"
        # arrays this op reads for the last time are free for its own result (elementwise in place is safe)
        for key in dict.fromkeys(reads):
            arr = names[key]
            if last_read[key] == i and arr in temps and not (key[0] == "s" and key[1] in yielded):
                free.setdefault(temps[arr], []).append(arr)
        if op_name == "cast":
            out = names[("s", result)] = fresh()
            lines.append(f"        {out} = {names[reads[0]]}.astype(DT[{rdt!r}])")
            if rdt not in HALF_NAMES:
                temps[out] = rdt
            continue
        ufunc = UFUNCS.get(op_name)
        if ufunc is None:
            raise CompilerError(f"numpy codegen: no code for {op_name!r} in a fused region")
        args = []
        for a in decode(m.properties["args"]):
            if isinstance(a, Operand):
                args.append(names[reads[a.index]])
            elif is_scalar_arg(a):  # scalars are arguments, so that a changed learning rate needs no new code
                args.append(f"consts[{n_const}]")
                n_const += 1
            else:
                raise CompilerError(f"numpy codegen: {op_name!r} has an argument {a!r} that is not a number")
        cdt = compute_dtype(m)
        pool = free.get(cdt)
        if op_name == "pow":
            # ``a ** b`` as the kernel writes it: an array module may take fast paths there (``x * x`` for ``** 2``)
            # that its ``power`` ufunc does not take
            out = fresh()
            temps[out] = cdt
            lines.append(f"        {out} = xp.asarray({args[0]} ** {args[1]})")
        elif pool:
            out = pool.pop()
            lines.append(f"        xp.{ufunc}({', '.join(args)}, out={out})")
        else:
            out = fresh()
            temps[out] = cdt
            lines.append(f"        {out} = xp.asarray(xp.{ufunc}({', '.join(args)}))  # 0-d: an array, not a scalar")
        if rdt in HALF_NAMES:  # rounded once, as the CPU kernels' ``astype`` of their float32 result
            names[("s", result)] = fresh()
            lines.append(f"        {names[('s', result)]} = {out}.astype(DT[{rdt!r}])")
            free.setdefault(cdt, []).append(out)
        else:
            names[("s", result)] = out
    outs = next(m for m in block.ops if isinstance(m, YieldOp)).operands
    lines.append(f"    return ({''.join(names[('s', v)] + ', ' for v in outs)})")
    return "\n".join(lines) + "\n"


def region_consts(templates: list[tuple[Any, ...]]) -> list[Any]:
    """The scalar arguments of a region's members (their decoded ``args``), in code order."""
    return [a for t in templates for a in t if is_scalar_arg(a)]


def member_templates(op: FusedOp) -> list[tuple[Any, ...]]:
    return [decode(m.properties["args"]) for m in op.body.block.ops if not isinstance(m, YieldOp)]


def compile_region(op: FusedOp) -> Callable[..., Any]:
    """The region as ``fn(consts, *inputs) -> tuple`` on NumPy arrays (cached by the region's IR)."""
    key = region_key(op)
    fn = _cache.get(key)
    if fn is None:
        scope: dict[str, Any] = {"DT": DTYPES}
        exec(compile(source(op), f"<blutrain fused {key[:12]}>", "exec"), scope)
        generated = scope["fused"]

        def fn(consts: list[Any], *inputs: Any) -> Any:
            return generated(np, consts, *inputs)

        _cache[key] = fn
    return fn


class NumpyTarget:
    """The "cpu" compile target: fused regions as generated NumPy functions, programs run launch by launch."""

    device = "cpu"

    def compile_region(self, op: FusedOp) -> Callable[..., Any]:
        return compile_region(op)

    def executor(self, program: Program, inputs: list[Any], state: list[Any]) -> CPUExecutor:
        from blutrain.compiler.executor import CPUExecutor  # the executor module builds on this one

        return CPUExecutor(program, inputs, state)


TARGET = NumpyTarget()

__all__ = ["DTYPES", "TARGET", "NumpyTarget", "compile_region", "member_templates", "region_consts", "region_key",
           "source"]
