"""In-place and aliasing analysis: which buffer each value lives in, and which ops write which buffers.

A traced step writes memory in place (the optimizer's multi-tensor kernel updates parameters and
moments, ``x[key] = v``, ``grad.mul_(c)``). Every other pass asks this analysis before it removes,
merges or moves an op. The pass form annotates the function: ``blutrain.state_written`` lists the
arguments the step updates in place, ``blutrain.mutated`` the ops whose result buffers are written
after they are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, IntAttr, ModuleOp
from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass

from blutrain.compiler.dialect import AssignOp, FusedOp, ViewOp, is_kernel
from blutrain.compiler.graph import body


def root_of(v: SSAValue) -> SSAValue:
    """The buffer a value lives in: views are followed to the value they view."""
    while isinstance(v.owner, ViewOp):
        v = v.owner.operands[0]
    return v


def written_operands(op: Operation) -> tuple[int, ...]:
    if isinstance(op, AssignOp):
        return (0,)
    w = op.properties.get("writes")
    if isinstance(w, ArrayAttr):
        return tuple(int(i.data) for i in w.data if isinstance(i, IntAttr))
    return ()


@dataclass
class AliasInfo:
    writes: dict[Operation, set[SSAValue]] = field(default_factory=dict)  # op → roots it writes
    mutated: set[SSAValue] = field(default_factory=set)  # roots written by some op

    def writes_anything(self, op: Operation) -> bool:
        return bool(self.writes.get(op))


def analyse(block: Block) -> AliasInfo:
    info = AliasInfo()
    for op in block.ops:
        idx = written_operands(op)
        if idx:
            roots = {root_of(op.operands[i]) for i in idx}
            info.writes[op] = roots
            info.mutated |= roots
    return info


def is_pure(op: Operation, info: AliasInfo) -> bool:
    """An op whose only effect is its results (a kernel writing nothing, a view, a fused region)."""
    return (is_kernel(op) or isinstance(op, (ViewOp, FusedOp))) and not info.writes_anything(op)


class InplaceAliasing(ModulePass):
    name = "inplace-aliasing"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = body(op)
        info = analyse(block)
        args = list(block.args)
        op.attributes["blutrain.state_written"] = ArrayAttr(
            [IntAttr(a.index) for a in args if isinstance(a, BlockArgument) and a in info.mutated])
        uids = []
        for o in block.ops:
            if any(r in info.mutated for r in o.results):
                uid = o.properties.get("uid")
                if isinstance(uid, IntAttr):
                    uids.append(uid)
        op.attributes["blutrain.mutated"] = ArrayAttr(uids)


__all__ = ["AliasInfo", "InplaceAliasing", "analyse", "is_pure", "root_of", "written_operands"]
