"""Common-subexpression elimination: a pure op identical to an earlier one (same op, same properties,
same operands, none of whose buffers was written in between) is replaced by the earlier one's results.

Ops whose result buffers are written later are never merged (two zero-filled gradient buffers are two
buffers), nor ops marked ``dynamic`` (their scalars change from call to call).
"""

from __future__ import annotations

from typing import Any

from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, IntAttr, ModuleOp
from xdsl.ir import SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import analyse, is_pure, root_of

_IGNORED = frozenset({"uid", "kernel", "offsets"})


class CommonSubexpressionElimination(ModulePass):
    name = "cse"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = body(op)
        info = analyse(block)
        version: dict[SSAValue, int] = {}
        seen: dict[Any, Any] = {}
        merged: list[IntAttr] = []
        for o in list(block.ops):
            if info.writes_anything(o):
                for r in info.writes[o]:
                    version[r] = version.get(r, 0) + 1
                continue
            if (not is_pure(o, info) or "dynamic" in o.properties or o.regions
                    or any(r in info.mutated for r in o.results)):
                continue
            props = tuple(sorted((k, str(v)) for k, v in o.properties.items() if k not in _IGNORED))
            operands = tuple((id(v), version.get(root_of(v), 0)) for v in o.operands)
            key = (o.name, props, operands, tuple(str(r.type) for r in o.results))
            first = seen.get(key)
            if first is None:
                seen[key] = o
                continue
            uid = o.properties.get("uid")
            if isinstance(uid, IntAttr):
                merged.append(uid)
            for old, new in zip(o.results, first.results, strict=True):
                old.replace_all_uses_with(new)
            Rewriter.erase_op(o)
        before = op.attributes.get("blutrain.merged")
        previous = [a for a in before.data if isinstance(a, IntAttr)] if isinstance(before, ArrayAttr) else []
        op.attributes["blutrain.merged"] = ArrayAttr([*previous, *merged])


__all__ = ["CommonSubexpressionElimination"]
