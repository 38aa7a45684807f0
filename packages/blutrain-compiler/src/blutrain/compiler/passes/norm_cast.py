"""Norm-output cast: ``cast(layer_norm(x).y, dtype)`` becomes one ``layer_norm`` that writes ``y`` in
``dtype``; the same for ``rms_norm`` (Llama-style blocks).

Under autocast LayerNorm runs in float32 and the GEMM after it in bf16, so each LayerNorm output is written
in float32 only for a cast to read it and write it again in bf16 (GPT-2: three passes over a tensor of the
residual stream's size per LayerNorm, 25 LayerNorms a step). The forward kernel takes the output dtype and
rounds each float32 result once on its way out (``blutrain.tensor.cpu.nn`` and ``blutrain.kernels.cuda``),
as the cast did: the result is eager's bit for bit.

The pattern: a ``layer_norm`` or ``rms_norm`` whose output ``y`` has one use, a ``cast`` to another floating
dtype. Its backward reads x and the saved statistics, never ``y``, so nothing else needs the float32 output.
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

# norm kernel → its number of arguments before the output dtype (which a residual operand follows)
NORMS: dict[str, int] = {"layer_norm": 5, "rms_norm": 4}


def _norm(op: Operation) -> str | None:
    return next((name for name in NORMS if plain_call(op, name)), None)


def match(op: Operation) -> Operation | None:
    """The cast that is the one reader of a ``layer_norm``'s or ``rms_norm``'s output, or None."""
    name = _norm(op)
    if name is None:
        return None
    n = NORMS[name]
    args = decode(op.properties["args"])
    ret = decode(op.properties["ret"])
    # n arguments, or n + 2 with a residual (layernorm-residual's) and no output dtype yet
    if (len(args) not in (n, n + 2) or (len(args) == n + 2 and args[n] is not None)
            or not isinstance(ret, (list, tuple)) or not isinstance(ret[0], Operand)):
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
            name = _norm(norm)
            assert name is not None  # the match found it
            args = list(decode(norm.properties["args"]))
            args[NORMS[name]:NORMS[name] + 1] = [to]  # the output dtype, after eps and k, before a residual
            types = [r.type for r in norm.results]
            types[y_index] = cast.results[0].type
            fused = kernel_op_class(name).create(
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


__all__ = ["NORMS", "LayerNormCast", "match"]
