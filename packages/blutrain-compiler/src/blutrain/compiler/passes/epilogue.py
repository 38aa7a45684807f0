"""GEMM-epilogue fusion: ``r + linear(x, W, b)`` (a residual added to a projection) becomes one
``linear_add`` op, which a device runs as one GEMM whose epilogue adds the bias and the residual
(cuBLASLt on cuda), so that neither the product nor the sum is a pass over memory of its own.

The pattern is a ``linear`` whose result has one use: an ``add`` with a tensor of the sum's shape and
dtype (no broadcasting), directly or through one ``cast`` (autocast's bf16 product widened to the
float32 residual stream). The fused op takes the add's place, so no op between the linear and the add
may write its input, weight or bias. In float32 and float64 the result is the two ops' to rounding (the
CPU kernel adds in eager order, bit for bit); through a cast the product is no longer rounded to the
half dtype before the add (one rounding less than eager). The bias (``linear`` adds its own in its
epilogue already) and GELU (``linear_gelu``) are ops of their own that models call directly.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import Operand, encode, kernel_op_class, type_info
from blutrain.compiler.passes.patterns import Scan, kernel_values, only_use, plain_kernel, same_type_add
from blutrain.tensor.dtype import FLOATING_NAMES


def match(linear: Operation) -> tuple[Operation, SSAValue, list[Operation]] | None:
    """(the add, the residual, the ops the fused op replaces) for a ``linear`` that feeds a residual add."""
    if not plain_kernel(linear, "linear") or linear.properties["dtype"].data not in FLOATING_NAMES:  # type: ignore[attr-defined]
        return None
    args = kernel_values(linear)
    if args is None or len(args) != 3 or args[0] is None or args[1] is None:
        return None
    chain = [linear]
    value = linear.results[0]
    cast = only_use(value)
    if cast is not None and plain_kernel(cast, "cast"):
        chain.append(cast)
        value = cast.results[0]
    found = same_type_add(value)
    if found is None or type_info(value.type)[1].name not in FLOATING_NAMES:
        return None
    add, residual = found
    return add, residual, [*chain, add]


class GemmEpilogueFusion(ModulePass):
    name = "gemm-epilogue"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        for linear, (add, residual, replaced) in scan.matches(match):
            x, w, b = kernel_values(linear)  # type: ignore[misc]
            if x is None or w is None or scan.written_between(linear, add, [x, w, b]):
                continue
            operands: list[SSAValue] = [residual, x, w] + ([b] if b is not None else [])
            args = (Operand(0), Operand(1), Operand(2), Operand(3) if b is not None else None)
            fused = kernel_op_class("linear_add").create(
                operands=operands, result_types=[add.results[0].type],
                properties={"args": encode(args), "ret": add.properties["ret"], "device": linear.properties["device"],
                            "dtype": StringAttr(linear.properties["dtype"].data)})  # type: ignore[attr-defined]
            Rewriter.insert_op(fused, InsertPoint.before(add))
            add.results[0].replace_all_uses_with(fused.results[0])
            for o in reversed(replaced):
                Rewriter.erase_op(o)


__all__ = ["GemmEpilogueFusion", "match"]
