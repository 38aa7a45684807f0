"""Elementwise fusion: chains of elementwise ops (with broadcast inputs) become one ``blutrain.fused``
op, which codegen turns into one generated kernel (NumPy on the CPU, a CUDA elementwise kernel).

An op joins the region of the op producing one of its operands when both compute in the same
floating dtype and produce the same shape (the region's iteration shape; inputs may broadcast to it).
The fused op takes the place of the region's last op, so a region may not grow past an op that
writes memory, nor past a non-member that reads one of its values. Values read outside the region
are its results. Ops whose scalars change between calls (``dynamic``) are not fused: their
constants are baked into the generated code.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import FusedOp, YieldOp, is_kernel, kernel_name, type_info
from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import analyse

# ops whose kernels are one ufunc each, in the same form on every array module (codegen mirrors them)
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum", "neg", "exp", "log", "sqrt",
                         "tanh", "abs"})
FLOATS = frozenset({"float32", "float64"})


def fusible(op: Operation) -> bool:
    if not is_kernel(op) or kernel_name(op) not in ELEMENTWISE or "dynamic" in op.properties:
        return False
    if "writes" in op.properties or len(op.results) != 1:
        return False
    dtype = op.properties["dtype"].data  # type: ignore[attr-defined]
    return dtype in FLOATS and type_info(op.results[0].type)[1].name == dtype


class _Region:
    def __init__(self, op: Operation, pos: int) -> None:
        self.ops = [op]
        self.first = pos
        self.shape = op.results[0].type
        self.dtype = op.properties["dtype"]


def regions(block: Block) -> list[list[Operation]]:
    """The fusion regions of ``block`` (two or more ops each), members in program order."""
    info = analyse(block)
    ops = list(block.ops)
    pos = {o: i for i, o in enumerate(ops)}
    region_of: dict[Operation, _Region] = {}
    write_positions = [i for i, o in enumerate(ops) if info.writes_anything(o)]
    found: list[_Region] = []
    for i, o in enumerate(ops):
        if not fusible(o) or o.results[0] in info.mutated:
            continue
        target = None
        for v in o.operands:
            r = region_of.get(v.owner) if isinstance(v.owner, Operation) else None
            if r is None or r.shape != o.results[0].type or r.dtype != o.properties["dtype"]:
                continue
            if any(r.first < w < i for w in write_positions):
                continue
            members = set(r.ops)
            if any(u.operation not in members and u.operation is not o and pos.get(u.operation, len(ops)) < i
                   for m in r.ops for u in m.results[0].uses):
                continue
            target = r
            break
        if target is None:
            region_of[o] = _Region(o, i)
            found.append(region_of[o])
        else:
            target.ops.append(o)
            region_of[o] = target
    return [r.ops for r in found if len(r.ops) > 1]


def fuse(members: list[Operation]) -> FusedOp:
    """Replace ``members`` (in program order) by one ``blutrain.fused`` op at the last one's place."""
    member_set = set(members)
    inputs: list[SSAValue] = []
    for m in members:
        for v in m.operands:
            if v.owner not in member_set and v not in inputs:
                inputs.append(v)
    outputs = [m.results[0] for m in members
               if m is members[-1] or any(u.operation not in member_set for u in m.results[0].uses)]
    block = Block(arg_types=[v.type for v in inputs])
    mapping: dict[SSAValue, SSAValue] = dict(zip(inputs, block.args, strict=True))
    for m in members:
        clone = m.clone(value_mapper=mapping)
        block.add_op(clone)
    block.add_op(YieldOp.create(operands=[mapping[v] for v in outputs]))
    fused = FusedOp.create(operands=inputs, result_types=[v.type for v in outputs], regions=[Region(block)])
    Rewriter.insert_op(fused, InsertPoint.before(members[-1]))
    for old, new in zip(outputs, fused.results, strict=True):
        old.replace_all_uses_with(new)
    for m in reversed(members):
        Rewriter.erase_op(m)
    return fused


class ElementwiseFusion(ModulePass):
    name = "elementwise-fusion"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = body(op)
        for members in regions(block):
            fuse(members)


__all__ = ["ELEMENTWISE", "ElementwiseFusion", "fuse", "fusible", "regions"]
