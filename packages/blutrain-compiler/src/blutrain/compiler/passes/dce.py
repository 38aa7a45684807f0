"""Dead-code elimination: pure ops whose results nothing reads are removed (last op first, so that
chains of dead ops go in one sweep). Ops that write memory stay."""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import analyse, is_pure


class DeadCodeElimination(ModulePass):
    name = "dce"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = body(op)
        info = analyse(block)
        for o in reversed(list(block.ops)):
            if is_pure(o, info) and all(not r.uses for r in o.results):
                Rewriter.erase_op(o)


__all__ = ["DeadCodeElimination"]
