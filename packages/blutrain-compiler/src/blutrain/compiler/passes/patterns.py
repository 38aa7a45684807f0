"""Small questions the fusing passes ask of a block: the one user of a value, whether an op is a plain kernel
call, a kernel op's arguments as values, and whether an op between two others writes what they read; and the
walk over a module's ops that each such pass makes (:class:`Scan`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from blutrain.compiler.dialect import Operand, decode, is_kernel, kernel_name
from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import AliasInfo, analyse, root_of

Found = TypeVar("Found")


def only_use(v: SSAValue) -> Operation | None:
    """The op that reads ``v``, if exactly one does: only then may a fusion take the value away."""
    uses = list(v.uses)
    return uses[0].operation if len(uses) == 1 else None


def plain_call(op: Operation, name: str) -> bool:
    """A call of kernel ``name`` with no data-dependent shape and no in-place write (any number of results)."""
    return (is_kernel(op) and kernel_name(op) == name and "dynamic" not in op.properties
            and "writes" not in op.properties)


def plain_kernel(op: Operation, name: str) -> bool:
    """A one-result :func:`plain_call`."""
    return plain_call(op, name) and len(op.results) == 1


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


def same_type_add(value: SSAValue) -> tuple[Operation, SSAValue] | None:
    """(the add, its other operand) where ``value``'s one reader adds it to a tensor of the sum's type (no
    broadcasting): an add that the op producing ``value`` can take over."""
    add = only_use(value)
    if add is None or not plain_kernel(add, "add"):
        return None
    operands = kernel_values(add)
    if operands is None or len(operands) != 2 or operands.count(value) != 1:
        return None
    other = operands[1] if operands[0] is value else operands[0]
    if other is None or other.type != value.type or add.results[0].type != value.type:
        return None
    return add, other


def written_between(info: AliasInfo, ops: list[Operation], start: int, stop: int,
                     values: list[SSAValue | None]) -> bool:
    """Whether an op strictly between ``ops[start]`` and ``ops[stop]`` writes memory under ``values``: a fused
    op that reads them at one place instead of the other would then see other data."""
    roots = {root_of(v) for v in values if v is not None}
    return any(roots & info.writes.get(o, set()) for o in ops[start + 1:stop])


class Scan:
    """A module's ops in their order, each one's position and what each writes (taken before any rewrite):
    a fusing pass walks the matches and asks whether an op between two of them writes what it moves."""

    def __init__(self, module: ModuleOp) -> None:
        block = body(module)
        self.info = analyse(block)
        self.ops = list(block.ops)
        self.pos = {o: i for i, o in enumerate(self.ops)}

    def matches(self, match: Callable[[Operation], Found | None]) -> Iterator[tuple[Operation, Found]]:
        """(op, what ``match`` found) for each op still in the block, in order."""
        for op in self.ops:
            found = match(op) if op.parent is not None else None
            if found is not None:
                yield op, found

    def written_between(self, first: Operation, last: Operation, values: list[SSAValue | None]) -> bool:
        return written_between(self.info, self.ops, self.pos[first], self.pos[last], values)


__all__ = ["Scan", "kernel_values", "only_use", "plain_call", "plain_kernel", "same_type_add",
           "written_between"]
