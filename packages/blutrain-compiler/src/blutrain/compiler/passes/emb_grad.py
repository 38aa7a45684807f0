"""Tied-weight gradient accumulation: ``add(mul(g, s), embedding_backward(grad, idx, V))`` (or ``add(g,
embedding_backward(...))``) becomes one ``embedding_backward(grad, idx, V, g, s)`` that writes ``g * s + the
rows summed per id`` as it stores the rows.

GPT-2 ties the token embedding to the LM head, so autograd adds the weight's two gradients: the head's, which
``linear_cross_entropy``'s rule multiplies by the 0-d loss scale, and the embedding's. Unfused, that is the
embedding backward writing all of wte's [50304, 768] float32 entries and then one fused elementwise kernel
reading both and the product's operand again (docs/benchmarks.md has the timings). The embedding backward
writes every row anyway (zero rows included), so it takes the head's gradient and the scale as ``addend`` /
``addend_scale`` and the product and the sum are no pass over memory of their own.

The pattern, at the plain ops (the pass runs before ``elementwise-fusion``):

- a plain ``embedding_backward(grad, idx, V)`` (no addend yet, any float dtype) whose result has one reader,
- that reader an ``add`` of two tensors of the result's type (no broadcasting) with the embedding's gradient as
  its *second* operand: autograd adds the head's gradient first, and the kernel puts the product first, so NaN
  payloads (the CPU's first-operand NaN) and signed zeros come out as the add made them;
- the add's first operand either the one-reader result of a ``mul(g, s)`` with ``g`` of the result's type and
  ``s`` a 0-d tensor of its dtype, in that order (then ``addend = g``, ``addend_scale = s``), or any other tensor
  of the result's type (``addend`` alone);
- no op between the embedding backward and the add writes ``grad`` or ``idx``, and none between the multiply
  and the add writes ``g`` or ``s`` (else the product stays and is the addend): the fused op, placed where the
  add was, reads them later than the ops it replaces.

The kernels (CPU: ``blutrain.tensor.cpu.indexing``; cuda: embedding.cu, and the backend's generic one) round
the product, the sums and their sum to the dtype as the separate ops do, so the compiled step is eager's bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import Operand, decode, encode, kernel_op_class, type_info
from blutrain.compiler.passes.patterns import Scan, kernel_values, only_use, plain_kernel, same_type_add
from blutrain.tensor.dtype import FLOATING_NAMES


@dataclass(frozen=True)
class TiedGradSum:
    """What one match replaces: the add, the multiply (None without a scale), the addend and the scale."""

    add: Operation
    mul: Operation | None
    addend: SSAValue
    scale: SSAValue | None


def _scaled(value: SSAValue, like: SSAValue) -> tuple[Operation, SSAValue, SSAValue] | None:
    """(the mul, g, s) where ``value`` is a one-reader ``mul(g, s)`` of a tensor of ``like``'s type by a 0-d
    tensor of its dtype."""
    mul = value.owner
    if not isinstance(mul, Operation) or not plain_kernel(mul, "mul") or only_use(value) is None:
        return None
    operands = kernel_values(mul)
    if operands is None or len(operands) != 2:
        return None
    g, s = operands
    if g is None or s is None:
        return None
    shape, dtype = type_info(s.type)
    if g.type != like.type or value.type != like.type or shape != () or dtype != type_info(like.type)[1]:
        return None
    return mul, g, s


def match(op: Operation) -> TiedGradSum | None:
    """The tied-gradient sum that a plain ``embedding_backward`` ``op`` can take over, or None."""
    if (not plain_kernel(op, "embedding_backward")
            or op.properties["dtype"].data not in FLOATING_NAMES):  # type: ignore[attr-defined]
        return None
    args = decode(op.properties["args"])
    if len(args) != 3 or not isinstance(args[0], Operand) or not isinstance(args[1], Operand):
        return None
    grad = op.results[0]
    found = same_type_add(grad)
    if found is None:
        return None
    add, other = found
    if kernel_values(add) != [other, grad]:  # the embedding's gradient second, as autograd adds it
        return None
    scaled = _scaled(other, grad)
    if scaled is None:
        return TiedGradSum(add, None, other, None)
    mul, g, s = scaled
    return TiedGradSum(add, mul, g, s)


class EmbeddingGradAdd(ModulePass):
    name = "embedding-grad-add"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        for emb, found in scan.matches(match):
            add = found.add
            if scan.written_between(emb, add, [*emb.operands, emb.results[0]]):
                continue
            if found.mul is not None and scan.written_between(found.mul, add, [found.addend, found.scale]):
                # g or s changes before the add: the product stays, and is the addend
                found = TiedGradSum(add, None, found.mul.results[0], None)
            args = decode(emb.properties["args"])
            operands = [*emb.operands, found.addend] + ([found.scale] if found.scale is not None else [])
            extra = tuple(Operand(i) for i in range(len(emb.operands), len(operands)))
            fused = kernel_op_class("embedding_backward").create(
                operands=operands, result_types=[emb.results[0].type],
                properties={"args": encode((*args, *extra)), "ret": emb.properties["ret"],
                            "device": emb.properties["device"], "dtype": emb.properties["dtype"]})
            Rewriter.insert_op(fused, InsertPoint.before(add))
            add.results[0].replace_all_uses_with(fused.results[0])
            Rewriter.erase_op(add)
            Rewriter.erase_op(emb)
            if found.mul is not None:
                Rewriter.erase_op(found.mul)


__all__ = ["EmbeddingGradAdd", "TiedGradSum", "match"]
