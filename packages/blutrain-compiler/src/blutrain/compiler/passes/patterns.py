"""Small questions the fusing passes ask of a block: the one user of a value, whether an op is a plain kernel
call, a kernel op's arguments as values, and whether an op between two others writes what they read."""

from __future__ import annotations

from xdsl.ir import Operation, SSAValue

from blutrain.compiler.dialect import Operand, decode, is_kernel, kernel_name
from blutrain.compiler.passes.aliasing import AliasInfo, root_of


def only_use(v: SSAValue) -> Operation | None:
    """The op that reads ``v``, if exactly one does: only then may a fusion take the value away."""
    uses = list(v.uses)
    return uses[0].operation if len(uses) == 1 else None


def plain_kernel(op: Operation, name: str) -> bool:
    """A one-result call of kernel ``name`` with no data-dependent shape and no in-place write."""
    return (is_kernel(op) and kernel_name(op) == name and "dynamic" not in op.properties
            and "writes" not in op.properties and len(op.results) == 1)


def kernel_values(op: Operation) -> list[SSAValue | None] | None:
    """The op's kernel arguments as values (None for a None argument), or None if one is not a value."""
    out: list[SSAValue | None] = []
    for a in decode(op.properties["args"]):
        if isinstance(a, Operand):
            out.append(op.operands[a.index])
        elif a is None:
            out.append(None)
        else:
            return None
    return out


def written_between(info: AliasInfo, ops: list[Operation], start: int, stop: int,
                     values: list[SSAValue | None]) -> bool:
    """Whether an op strictly between ``ops[start]`` and ``ops[stop]`` writes memory under ``values``: a fused
    op that reads them at one place instead of the other would then see other data."""
    roots = {root_of(v) for v in values if v is not None}
    return any(roots & info.writes.get(o, set()) for o in ops[start + 1:stop])


__all__ = ["kernel_values", "only_use", "plain_kernel", "written_between"]
