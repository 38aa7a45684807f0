"""LayerNorm-gradient accumulation: ``g + layer_norm_backward(...).dx`` becomes one ``layer_norm_backward``
that adds ``g`` to its dx as it stores it.

In a residual network the input of each LayerNorm also feeds the residual path, so autograd adds the two
gradients of that input: the residual stream's and the LayerNorm's dx (GPT-2: two per block, each a pass
that reads two and writes one tensor of the stream's size). The backward kernel takes the other gradient
as ``addend`` and adds it to every dx element before the store (``blutrain.tensor.cpu.nn`` and
``blutrain.kernels.cuda`` both), so the sum is no separate pass over memory.

The pattern: a ``layer_norm_backward`` in float32 or float64 whose dx has one use, an ``add`` whose other
operand has dx's type (no broadcasting). In these dtypes the fused op rounds the sum once, as the add
did: the result is eager's bit for bit. The fused op takes the old one's place when the other gradient
exists there already, else the add's; either way no op between them may write what it reads.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import Operand, decode, encode, kernel_op_class
from blutrain.compiler.passes.patterns import Scan, plain_call, same_type_add

DTYPES = frozenset({"float32", "float64"})


def match(op: Operation) -> tuple[Operation, SSAValue] | None:
    """(the add, the other gradient) for a ``layer_norm_backward`` whose dx is added to another gradient."""
    if (not plain_call(op, "layer_norm_backward")
            or op.properties["dtype"].data not in DTYPES):  # type: ignore[attr-defined]
        return None
    args = decode(op.properties["args"])
    ret = decode(op.properties["ret"])
    if len(args) != 8 or not isinstance(ret, (list, tuple)) or not isinstance(ret[0], Operand):
        return None
    return same_type_add(op.results[ret[0].index])


def _defined_before(value: SSAValue, op: Operation, pos: dict[Operation, int]) -> bool:
    owner = value.owner
    return not isinstance(owner, Operation) or pos.get(owner, len(pos)) < pos[op]


class LayerNormGradAdd(ModulePass):
    name = "layernorm-grad-add"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        pos = scan.pos
        for norm, (add, other) in scan.matches(match):
            if scan.written_between(norm, add, [*norm.operands, other]):
                continue
            if _defined_before(other, norm, pos):
                where = InsertPoint.before(norm)
            elif all(pos.get(u.operation, pos[add]) >= pos[add] for r in norm.results for u in r.uses):
                where = InsertPoint.before(add)  # nothing reads dw or db before the add
            else:
                continue
            args = (*decode(norm.properties["args"]), Operand(len(norm.operands)))
            fused = kernel_op_class("layer_norm_backward").create(
                operands=[*norm.operands, other], result_types=[r.type for r in norm.results],
                properties={"args": encode(args), "ret": norm.properties["ret"], "device": norm.properties["device"],
                            "dtype": norm.properties["dtype"]})
            Rewriter.insert_op(fused, where)
            ret = decode(norm.properties["ret"])
            dx_index = ret[0].index
            add.results[0].replace_all_uses_with(fused.results[dx_index])
            Rewriter.erase_op(add)
            for old, new in zip(norm.results, fused.results, strict=True):
                old.replace_all_uses_with(new)
            Rewriter.erase_op(norm)


__all__ = ["LayerNormGradAdd", "match"]
