"""Liveness-based memory planning: every intermediate buffer gets an offset in one arena.

A buffer is a result of a kernel or fused op (views live in their buffer; arguments — inputs and
state — live outside the arena). It is live from the op that makes it to the last op that reads or
writes it or any view of it; the step's outputs live to the end. Buffers are placed largest first,
each at the lowest offset (aligned to 256 bytes, as CUDA allocations are) where it overlaps no placed
buffer whose lifetime overlaps its own: the greedy-by-size heuristic of static memory planners.

The pass writes ``offsets`` on each op and two module attributes: ``blutrain.arena_bytes`` (the
planned peak) and ``blutrain.buffer_bytes`` (the sum of all buffers: what a step would need if
nothing were reused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, IntAttr, ModuleOp
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from blutrain.compiler.dialect import FusedOp, ViewOp, is_kernel, type_info
from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import root_of

ALIGN = 256


@dataclass
class Buffer:
    value: SSAValue
    size: int
    start: int
    end: int
    offset: int = -1


def _nbytes(v: SSAValue) -> int:
    shape, dtype = type_info(v.type)
    n = math.prod(shape) * dtype.itemsize
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def buffers(block: Block) -> list[Buffer]:
    """Every arena buffer of ``block`` with its live interval (op positions, inclusive)."""
    ops = list(block.ops)
    found: dict[SSAValue, Buffer] = {}
    for i, o in enumerate(ops):
        if is_kernel(o) or isinstance(o, FusedOp):
            for r in o.results:
                found[r] = Buffer(r, _nbytes(r), i, i)
        for v in o.operands:
            b = found.get(root_of(v))
            if b is not None:
                b.end = i if not isinstance(o, func.ReturnOp) else len(ops)
    # a view read later keeps its buffer alive: extend through the views' uses
    for i, o in enumerate(ops):
        if isinstance(o, ViewOp):
            b = found.get(root_of(o.results[0]))
            if b is not None:
                b.end = max(b.end, i)
    return list(found.values())


def plan(bufs: list[Buffer]) -> int:
    """Assign offsets (greedy by size, lowest fit); returns the arena size."""
    placed: list[Buffer] = []
    arena = 0
    for b in sorted(bufs, key=lambda b: (-b.size, b.start)):
        live = sorted((p.offset, p.offset + p.size) for p in placed if p.start <= b.end and b.start <= p.end)
        offset = 0
        for lo, hi in live:
            if offset + b.size <= lo:
                break
            offset = max(offset, hi)
        b.offset = offset
        arena = max(arena, offset + b.size)
        placed.append(b)
    return arena


class MemoryPlan(ModulePass):
    name = "memory-plan"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = body(op)
        bufs = buffers(block)
        arena = plan(bufs)
        by_value = {b.value: b.offset for b in bufs}
        for o in block.ops:
            if isinstance(o, Operation) and o.results and (is_kernel(o) or isinstance(o, FusedOp)):
                o.properties["offsets"] = ArrayAttr([IntAttr(by_value[r]) for r in o.results])
        op.attributes["blutrain.arena_bytes"] = IntAttr(arena)
        op.attributes["blutrain.buffer_bytes"] = IntAttr(sum(b.size for b in bufs))


__all__ = ["ALIGN", "Buffer", "MemoryPlan", "buffers", "plan"]
