"""LayerNorm-output cast: ``cast(layer_norm(x).y, dtype)`` becomes one ``layer_norm`` that writes ``y`` in
``dtype``.

Under autocast LayerNorm runs in float32 and the GEMM after it in bf16, so each LayerNorm output is written
in float32 only for a cast to read it and write it again in bf16 (GPT-2: three passes over a tensor of the
residual stream's size per LayerNorm, 25 LayerNorms a step). The forward kernel takes the output dtype and
rounds each float32 result once on its way out (``blutrain.tensor.cpu.nn`` and ``blutrain.kernels.cuda``),
as the cast did: the result is eager's bit for bit.

The pattern: a ``layer_norm`` whose output ``y`` has one use, a ``cast`` to another floating dtype. Its
backward reads x and the saved statistics, never ``y``, so nothing else needs the float32 output.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import Operand, decode, encode, kernel_op_class, type_info
from blutrain.compiler.passes.patterns import Scan, only_use, plain_call, plain_kernel
from blutrain.tensor.dtype import FLOATING_NAMES


def match(op: Operation) -> Operation | None:
    """The cast that is the one reader of a ``layer_norm``'s output, or None."""
    if not plain_call(op, "layer_norm"):
        return None
    args = decode(op.properties["args"])
    ret = decode(op.properties["ret"])
    # 5 arguments, or 7 with a residual (layernorm-residual's) and no output dtype yet
    if (len(args) not in (5, 7) or (len(args) == 7 and args[5] is not None) or not isinstance(ret, (list, tuple))
            or not isinstance(ret[0], Operand)):
        return None
    cast = only_use(op.results[ret[0].index])
    if cast is None or not plain_kernel(cast, "cast"):
        return None
    if type_info(cast.results[0].type)[1].name not in FLOATING_NAMES:
        return None
    return cast


class LayerNormCast(ModulePass):
    name = "layernorm-cast"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for norm, cast in Scan(op).matches(match):
            ret = decode(norm.properties["ret"])
            y_index = ret[0].index
            to = decode(cast.properties["args"])[1]
            args = list(decode(norm.properties["args"]))
            args[5:6] = [to]  # the output dtype, after eps and k, before a residual
            types = [r.type for r in norm.results]
            types[y_index] = cast.results[0].type
            fused = kernel_op_class("layer_norm").create(
                operands=list(norm.operands), result_types=types,
                properties={"args": encode(tuple(args)), "ret": norm.properties["ret"],
                            "device": norm.properties["device"], "dtype": norm.properties["dtype"]})
            Rewriter.insert_op(fused, InsertPoint.before(norm))
            cast.results[0].replace_all_uses_with(fused.results[y_index])
            Rewriter.erase_op(cast)
            for i, (old, new) in enumerate(zip(norm.results, fused.results, strict=True)):
                if i != y_index:
                    old.replace_all_uses_with(new)
            Rewriter.erase_op(norm)


__all__ = ["LayerNormCast", "match"]
