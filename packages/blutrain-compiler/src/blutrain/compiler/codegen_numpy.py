"""NumPy codegen for the CPU target: a ``blutrain.fused`` region becomes one generated Python function.

The function computes the region's ops with the same ufuncs the CPU kernels call, so results are
bit-identical to eager mode, but writes every op after the first into a temporary that is dead by
then (``out=``), so a chain of n ops allocates one array instead of n. Functions are cached by the
hash of the region's IR text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.compiler.dialect import FusedOp, Operand, YieldOp, decode, kernel_name
from blutrain.compiler.errors import CompilerError

UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "pow": "power",
          "maximum": "maximum", "minimum": "minimum", "neg": "negative", "exp": "exp", "log": "log",
          "sqrt": "sqrt", "tanh": "tanh", "abs": "abs"}

_cache: dict[str, Callable[..., Any]] = {}


def region_key(op: FusedOp) -> str:
    return hashlib.sha256(str(op).encode()).hexdigest()


def source(op: FusedOp, name: str = "fused") -> str:
    """The Python source of the region's function ``name(xp, consts, *inputs) -> tuple of outputs``
    (``consts``: the members' scalar arguments, in order, as :func:`region_consts` lists them)."""
    block = op.body.block
    names: dict[Any, str] = {a: f"in{i}" for i, a in enumerate(block.args)}
    members = [m for m in block.ops if not isinstance(m, YieldOp)]
    yielded = next(m for m in block.ops if isinstance(m, YieldOp)).operands
    last_use: dict[Any, int] = {}
    for i, m in enumerate(members):
        for v in m.operands:
            last_use[v] = i
    temps: set[str] = set()
    lines = [f"def {name}(xp, consts, {', '.join(names[a] for a in block.args)}):",
             "    with xp.errstate(all='ignore'):"]
    n_const = 0
    for i, m in enumerate(members):
        op_name = kernel_name(m)
        ufunc = UFUNCS.get(op_name)
        if ufunc is None:
            raise CompilerError(f"numpy codegen: no code for {op_name!r} in a fused region")
        args = []
        for a in decode(m.properties["args"]):
            if isinstance(a, Operand):
                args.append(names[m.operands[a.index]])
            else:  # scalars are arguments, so that a changed learning rate needs no new code
                args.append(f"consts[{n_const}]")
                n_const += 1
        # reuse a temporary that this op reads for the last time and that no output needs
        out = next((names[v] for v in m.operands if names.get(v) in temps and last_use.get(v) == i
                    and v not in yielded), None)
        result = m.results[0]
        if out is None:
            out = f"t{i}"
            temps.add(out)
            lines.append(f"        {out} = xp.asarray(xp.{ufunc}({', '.join(args)}))  # 0-d: an array, not a scalar")
        else:
            lines.append(f"        xp.{ufunc}({', '.join(args)}, out={out})")
        names[result] = out
    lines.append(f"    return ({''.join(names[v] + ', ' for v in yielded)})")
    return "\n".join(lines) + "\n"


def region_consts(templates: list[tuple[Any, ...]]) -> list[Any]:
    """The scalar arguments of a region's members (their decoded ``args``), in code order."""
    return [a for t in templates for a in t if not isinstance(a, Operand)]


def member_templates(op: FusedOp) -> list[tuple[Any, ...]]:
    return [decode(m.properties["args"]) for m in op.body.block.ops if not isinstance(m, YieldOp)]


def compile_region(op: FusedOp) -> Callable[..., Any]:
    """The region as ``fn(consts, *inputs) -> tuple`` on NumPy arrays (cached by the region's IR)."""
    key = region_key(op)
    fn = _cache.get(key)
    if fn is None:
        scope: dict[str, Any] = {}
        exec(compile(source(op), f"<blutrain fused {key[:12]}>", "exec"), scope)
        generated = scope["fused"]

        def fn(consts: list[Any], *inputs: Any) -> Any:
            return generated(np, consts, *inputs)

        _cache[key] = fn
    return fn


class NumpyTarget:
    """The "codegen-numpy" target: fused regions as generated NumPy functions."""

    name = "codegen-numpy"
    device = "cpu"

    def compile_region(self, op: FusedOp) -> Callable[..., Any]:
        return compile_region(op)


TARGET = NumpyTarget()

__all__ = ["TARGET", "NumpyTarget", "compile_region", "member_templates", "region_consts", "region_key", "source"]
