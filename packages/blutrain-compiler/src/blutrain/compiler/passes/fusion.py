"""Elementwise fusion: chains of elementwise ops and casts (with broadcast inputs) become one
``blutrain.fused`` op, which codegen turns into one generated kernel (NumPy on the CPU, a CUDA
elementwise kernel).

An op joins the regions of the ops producing its operands (merging them) when they produce the same
shape (the region's iteration shape; inputs may broadcast to it), whatever their dtypes: ``cast(bf16 →
f32)``, ``add(f32, f32)`` and ``cast(f32 → bf16)`` are one kernel, and so is ``x.float() + y.float()``.
Each member keeps its eager semantics inside the region: its result is rounded to its own dtype as its
eager kernel rounds it (float16/bfloat16 members compute in float32 and round once), so a region is
bit-identical to its ops run one by one. The fused op takes the place of the region's last op, so a
region may not grow past an op that writes memory, nor past a non-member that reads one of its values;
a member written in place later (after the region) is fused like any other.
Values read outside the region are its results. Ops whose scalars change between calls (``dynamic``)
are not fused: their constants are baked into the generated code.
"""

from __future__ import annotations

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import FusedOp, Operand, YieldOp, decode, is_kernel, kernel_name, type_info
from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import analyse
from blutrain.tensor.dtype import FLOATING_NAMES, HALF_NAMES

# ops whose kernels are one ufunc each, in the same form on every array module (codegen mirrors them)
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum", "neg", "exp", "log", "sqrt",
                         "tanh", "abs"})
_NUMBER = (int, float, np.integer, np.floating)


def is_scalar_arg(a: object) -> bool:
    """A scalar argument of a fused member (a generated kernel's constant): a number, not a bool."""
    return isinstance(a, _NUMBER) and not isinstance(a, (bool, np.bool_))


def fusible(op: Operation) -> bool:
    """An elementwise op or a cast of floating dtypes whose operands and result have the dtypes its
    kernel computes in and whose other arguments are numbers (a cast: its target dtype)."""
    if not is_kernel(op) or "dynamic" in op.properties or "writes" in op.properties or len(op.results) != 1:
        return False
    name = kernel_name(op)
    if name != "cast" and name not in ELEMENTWISE:
        return False
    dtype = op.properties["dtype"].data  # type: ignore[attr-defined]
    result = type_info(op.results[0].type)[1]
    if dtype not in FLOATING_NAMES or any(type_info(v.type)[1].name != dtype for v in op.operands):
        return False
    args = decode(op.properties["args"])
    if name == "cast":  # (source, target dtype), between two floating dtypes
        return (result.name in FLOATING_NAMES and len(op.operands) == 1 and len(args) == 2 and args[0] == Operand(0)
                and isinstance(args[1], np.dtype) and args[1] == result.np)
    # an eager half kernel whose float32 result came back unrounded (a 0-d NumPy scalar) has another dtype
    return result.name == dtype and all(isinstance(a, Operand) or is_scalar_arg(a) for a in args)


def dtype_name(v: SSAValue) -> str:
    return type_info(v.type)[1].name


def compute_dtype(m: Operation) -> str:
    """The dtype a fused member's arithmetic runs in: float32 for float16/bfloat16 (its result rounded
    after, as the eager half-precision kernels do), else its own."""
    d = dtype_name(m.results[0])
    return "float32" if d in HALF_NAMES else d


def _shape(v: SSAValue) -> tuple[int, ...]:
    return type_info(v.type)[0]


class _Region:
    def __init__(self, op: Operation, pos: int) -> None:
        self.ops = [op]
        self.first = pos
        self.shape = _shape(op.results[0])


def regions(block: Block) -> list[list[Operation]]:
    """The fusion regions of ``block`` (two or more ops each), members in program order."""
    info = analyse(block)
    ops = list(block.ops)
    pos = {o: i for i, o in enumerate(ops)}
    region_of: dict[Operation, _Region] = {}
    write_positions = [i for i, o in enumerate(ops) if info.writes_anything(o)]
    found: list[_Region] = []

    def movable(rs: list[_Region], o: Operation, i: int) -> bool:
        """Whether the members of ``rs`` may all run at ``o``'s place ``i``: no non-member reads their values
        before it."""
        members = {m for r in rs for m in r.ops}
        return not any(u.operation not in members and u.operation is not o and pos.get(u.operation, len(ops)) < i
                       for m in members for u in m.results[0].uses)

    for i, o in enumerate(ops):
        # A member whose buffer some later op writes in place (clip_grad_norm_ scaling a gradient, say) is
        # fused too: the write-position check below keeps every write after the region's end, where the
        # fused op has made the value, so the write finds it in the fused op's result as it found it in the
        # member's. Refusing such ops left GPT-2's tied-weight gradient sum (dw · scale + the embedding's
        # gradient, then clipped) as two float32 passes over [V, C] where one suffices.
        if not fusible(o):
            continue
        candidates: list[_Region] = []
        for v in o.operands:
            r = region_of.get(v.owner) if isinstance(v.owner, Operation) else None
            if r is None or r in candidates or r.shape != _shape(o.results[0]):
                continue
            if any(r.first < w < i for w in write_positions):
                continue
            candidates.append(r)
        # join every region o reads (``x.float() + y.float()`` is one kernel), else the first one it may join
        targets = candidates if movable(candidates, o, i) else next(([r] for r in candidates if movable([r], o, i)), [])
        if not targets:
            region_of[o] = _Region(o, i)
            found.append(region_of[o])
            continue
        target = targets[0]
        for r in targets[1:]:
            target.ops += r.ops
            target.first = min(target.first, r.first)
            for m in r.ops:
                region_of[m] = target
            r.ops = []
        target.ops.sort(key=pos.__getitem__)
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


__all__ = ["ELEMENTWISE", "ElementwiseFusion", "compute_dtype", "dtype_name", "fuse", "fusible",
           "is_scalar_arg", "regions"]
