"""LayerNorm-gradient readers: the bfloat16 cast and the column sum of ``layer_norm_backward(...).dx``, written
by the backward as it stores dx.

Under autocast the float32 gradient of the residual stream leaves each LayerNorm backward (after
``layernorm-grad-add``: dx plus the stream's other gradient) for two more readers: autocast's cast to
bfloat16 for the backward GEMMs of the projection that wrote the stream, and that projection's bias gradient,
a float32 sum over the rows (autocast keeps the bias float32; ``linear_add``'s backward sums
``g.reshape(-1, C)``). Each is a pass over a tensor of the stream's size (GPT-2 124M at B=16, T=1024: 50 MB,
24 casts and 24 sums a step; docs/benchmarks.md has the time). ``layer_norm_backward`` takes ``dx_copy_dtype`` and
``need_dx_sum`` (``blutrain.tensor.cpu.nn`` and ``blutrain.kernels.cuda``) and writes the bf16 copy beside dx
and sums each column of dx as it stores it.

The pattern: a float32 ``layer_norm_backward`` (a plain kernel call, with or without addend) whose dx is read
by a ``cast`` to bfloat16, by a ``sum`` over dx's leading dims (keepdim false, the normalized shape out) of
dx itself or of a contiguous ``[rows, C]`` view of it, or by both, with nothing between the backward and the
reader that writes dx. dx keeps its other readers; the fused backward takes the old one's place, so the copy
and the sums exist from there on. float32 only: it is autocast's case, and the one the cuda kernels cover
(a float64 or bfloat16 LayerNorm backward would fall back to the generic kernel there).

Numerics. The copy is each stored dx rounded once to nearest even, a NaN made the quiet NaN of its sign, as
the cast kernel does: eager's bits, on the CPU and on cuda. The sums on the CPU are the same NumPy reduction
as the ``sum`` kernel's: eager's bits. On cuda they add in another order than ``sum_cols``: each thread over
its rows, then the block's row groups, then the blocks' partials (fixed orders, so deterministic, but not
``sum_cols``'s bits): a projection's bias gradient differs from eager's by float32 rounding (a float64
reference bounds both; the tests hold the kernel to it).
"""

from __future__ import annotations

import math
from typing import Any

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import (
    Operand,
    ViewOp,
    decode,
    encode,
    kernel_op_class,
    type_info,
)
from blutrain.compiler.passes.patterns import Scan, plain_call, plain_kernel


def _dx(op: Operation) -> SSAValue | None:
    """The float32 dx of a plain ``layer_norm_backward`` that does not yet write dx's other forms."""
    if not plain_call(op, "layer_norm_backward"):
        return None
    args = decode(op.properties["args"])
    ret = decode(op.properties["ret"])
    if len(args) not in (8, 9) or not isinstance(ret, tuple) or len(ret) != 3 or not isinstance(ret[0], Operand):
        return None
    dx = op.results[ret[0].index]
    return dx if type_info(dx.type)[1].name == "float32" else None


def _reads(op: Operation, value: SSAValue) -> tuple[Any, ...] | None:
    """The op's decoded arguments if its first is ``value`` (a cast or a sum of it), else None."""
    args = decode(op.properties["args"])
    if not args or not isinstance(args[0], Operand) or op.operands[args[0].index] is not value:
        return None
    return tuple(args)


def _bf16_cast(dx: SSAValue) -> Operation | None:
    for use in dx.uses:
        op: Operation = use.operation
        if (plain_kernel(op, "cast") and _reads(op, dx) is not None
                and type_info(op.results[0].type)[1].name == "bfloat16"):
            return op
    return None


def _lead_sum(op: Operation, value: SSAValue, lead: int, ns: tuple[int, ...]) -> bool:
    """Whether ``op`` is ``sum(value, axes=the leading lead dims, keepdim=False)`` of shape ``ns``, float32."""
    if not plain_kernel(op, "sum"):
        return False
    args = _reads(op, value)
    if args is None or len(args) != 3 or args[2] is not False or not isinstance(args[1], tuple):
        return False
    nd = len(type_info(value.type)[0])
    axes = sorted(int(a) % nd for a in args[1])
    shape, dtype = type_info(op.results[0].type)
    return axes == list(range(lead)) and shape == ns and dtype.name == "float32"


def _row_view(view: Operation, dx: SSAValue, c: int) -> bool:
    """Whether ``view`` is dx as a contiguous ``[rows, c]`` matrix (what a ``reshape(-1, c)`` traces to)."""
    if not isinstance(view, ViewOp) or view.operands[0] is not dx or view.offset.data != 0:
        return False
    shape = type_info(view.results[0].type)[0]
    return len(shape) == 2 and shape[1] == c and decode(view.strides) == (c, 1)


def _column_sum(dx: SSAValue, k: int) -> Operation | None:
    """A ``sum`` of dx's columns over its leading dims, read from dx or from a ``[rows, C]`` view of it."""
    shape = type_info(dx.type)[0]
    lead = len(shape) - k
    if lead < 1:
        return None
    ns = shape[lead:]
    c = math.prod(ns)
    for use in dx.uses:
        op: Operation = use.operation
        if _lead_sum(op, dx, lead, ns):
            return op
        if _row_view(op, dx, c):
            for inner in op.results[0].uses:
                total: Operation = inner.operation
                if _lead_sum(total, op.results[0], 1, ns):
                    return total
    return None


def match(op: Operation) -> tuple[Operation | None, Operation | None] | None:
    """(the bf16 cast of dx, the column sum of dx) of a float32 ``layer_norm_backward``, either None but not
    both, or None."""
    dx = _dx(op)
    if dx is None:
        return None
    k = decode(op.properties["args"])[5]
    cast, total = _bf16_cast(dx), _column_sum(dx, int(k))
    return (cast, total) if cast is not None or total is not None else None


class LayerNormGradOutputs(ModulePass):
    name = "layernorm-grad-outputs"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        for norm, (cast, total) in scan.matches(match):
            ret = decode(norm.properties["ret"])
            dx = norm.results[ret[0].index]
            # the readers now read dx where it is made: nothing in between may change it
            if cast is not None and scan.written_between(norm, cast, [dx]):
                cast = None
            if total is not None and scan.written_between(norm, total, [dx]):
                total = None
            if cast is None and total is None:
                continue
            args = decode(norm.properties["args"])
            addend = args[8] if len(args) == 9 else None
            to = None if cast is None else decode(cast.properties["args"])[1]
            types = [r.type for r in norm.results]
            extra: list[Operand | None] = []
            for reader in (cast, total):
                extra.append(None if reader is None else Operand(len(types)))
                if reader is not None:
                    types.append(reader.results[0].type)
            fused = kernel_op_class("layer_norm_backward").create(
                operands=list(norm.operands), result_types=types,
                properties={"args": encode((*args[:8], addend, to, total is not None)),
                            "ret": encode((*ret, *extra)), "device": norm.properties["device"],
                            "dtype": norm.properties["dtype"]})
            Rewriter.insert_op(fused, InsertPoint.before(norm))
            for old, new in zip(norm.results, fused.results[:len(norm.results)], strict=True):
                old.replace_all_uses_with(new)
            Rewriter.erase_op(norm)
            for reader, index in zip((cast, total), extra, strict=True):
                if reader is None or index is None:
                    continue
                reader.results[0].replace_all_uses_with(fused.results[index.index])
                source = reader.operands[0].owner
                Rewriter.erase_op(reader)
                if isinstance(source, ViewOp) and not source.results[0].uses:
                    Rewriter.erase_op(source)  # the [rows, C] view only the sum read


__all__ = ["LayerNormGradOutputs", "match"]
