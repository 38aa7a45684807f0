"""LayerNorm residual: the residual add before a LayerNorm (or an RMSNorm: Llama-style blocks) becomes part of
the norm, and the projection that fed it a plain bf16 GEMM.

Under autocast a transformer block's output projection meets the float32 residual stream and the sum goes
straight into the next LayerNorm. As one ``linear_add`` (the model's, or ``gemm-epilogue``'s) the GEMM's
epilogue reads and writes the float32 stream, which makes the GEMM much slower than the same GEMM writing bf16
alone (docs/benchmarks.md has the timings), and a LayerNorm then reads the sum again. Here the GEMM writes its
bf16 product and ``layer_norm(..., residual=r)`` (``blutrain.tensor.cpu.nn``, ``blutrain.kernels.cuda``) forms
s = r + product as it reads its row, writes s (float32: the residual stream goes on from it) and normalizes
it: the stream is read and written once.

The pattern: a ``layer_norm`` or ``rms_norm`` (no output dtype, no residual yet; the kernels' ``residual``
operand is the same for both) whose input is a float32 sum of the stream
r (a tensor of the sum's type) and a bfloat16 projection, in one of the two forms autocast traces:

* ``add(r, cast(linear(x, W, b), float32))`` (``r + proj(h)``): the linear's one reader is the cast and the
  cast's the add. The fused LayerNorm adds the linear's bf16 result, widened exactly, to r with one float32
  rounding, as the add did: the result is eager's bit for bit (CPU; on cuda the kernels' bits of the add
  and the LayerNorm).
* ``linear_add(r, x, W, b)`` with bf16 x and W (what ``blutrain.models.gpt2`` records: its blocks call
  ``linear_add`` themselves), only in ``layernorm-residual-linear-add``: becomes
  ``linear(x, W, cast(b, bfloat16))``, the bias added in the GEMM's epilogue as the plain op adds it, rounded
  to bf16. That is eager's bits of ``r + proj(h)``, and PyTorch's numerics, but not of ``linear_add``, whose
  product is not rounded to bf16 before the residual is added (one rounding fewer). So that compiled stays
  eager's bits by default, this form is a pass of its own, outside the default pipeline: name it in
  ``compile(passes=...)`` (before ``gemm-epilogue``) to trade the bits for the GEMM without the epilogue.

Every other reader of the sum (the next residual add, the LayerNorm's backward, which saves its input) reads
s instead, so each must come after the LayerNorm; the add moves to the LayerNorm's place, so nothing in
between may write r (nor the product). A sum read before its LayerNorm, or one that no LayerNorm reads (the
last block's, where only the stream goes on), keeps its add or ``linear_add``. The pass runs before
``gemm-epilogue`` so that the add form is still an add; ``layernorm-cast`` then gives the fused LayerNorm its
bf16 output as it gives the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import (
    Operand,
    decode,
    encode,
    kernel_op_class,
    tensor_type,
    type_info,
)
from blutrain.compiler.passes.patterns import Scan, kernel_values, only_use, plain_call, plain_kernel
from blutrain.tensor.dtype import bfloat16

PROJECTION = bfloat16.name  # the dtype of the projection (and of its operands) that the pass fuses
STREAM = "float32"  # the residual stream's dtype


@dataclass(frozen=True)
class ResidualSum:
    """The sum a LayerNorm reads: the op that makes it (``add`` or ``linear_add``), the stream r, and the ops
    the fused LayerNorm replaces besides itself (the add and the cast; the linear_add)."""

    maker: Operation
    residual: SSAValue
    replaced: tuple[Operation, ...]
    linear: Operation | None  # the add form's linear, which stays and feeds the LayerNorm


def _dtype(v: SSAValue) -> str:
    return type_info(v.type)[1].name


def _add_form(add: Operation, total: SSAValue) -> ResidualSum | None:
    """``add(r, cast(linear(...), float32))`` with the linear and the cast read by nothing else."""
    operands = kernel_values(add)
    if operands is None or len(operands) != 2 or None in operands:
        return None
    for widened, residual in ((operands[1], operands[0]), (operands[0], operands[1])):
        assert widened is not None and residual is not None
        cast = widened.owner
        if (not isinstance(cast, Operation) or not plain_kernel(cast, "cast") or only_use(widened) is not add
                or residual is widened or residual.type != total.type or widened.type != total.type):
            continue
        source = cast.operands[0]
        linear = source.owner
        if (isinstance(linear, Operation) and plain_kernel(linear, "linear") and _dtype(source) == PROJECTION
                and only_use(source) is cast and decode(cast.properties["args"])[0] == Operand(0)):
            return ResidualSum(add, residual, (add, cast), linear)
    return None


def _linear_add_form(op: Operation, total: SSAValue) -> ResidualSum | None:
    """``linear_add(r, x, W, b)`` with bf16 x and W, r of the sum's type."""
    values = kernel_values(op)
    if values is None or len(values) != 4:
        return None
    residual, x, w, b = values
    if residual is None or x is None or w is None:
        return None
    if (residual.type != total.type or _dtype(x) != PROJECTION or _dtype(w) != PROJECTION
            or (b is not None and _dtype(b) not in (PROJECTION, STREAM))):
        return None
    return ResidualSum(op, residual, (op,), None)


# norm kernel → (its arguments before the output dtype and the residual, its results before the sum)
NORMS: dict[str, tuple[int, int]] = {"layer_norm": (5, 3), "rms_norm": (4, 2)}


def _norm(op: Operation) -> str | None:
    return next((name for name in NORMS if plain_call(op, name)), None)


def match(norm: Operation, linear_add: bool = False) -> ResidualSum | None:
    """The float32 residual sum that a plain ``layer_norm`` or ``rms_norm`` reads, made by the add form (or,
    with ``linear_add``, by a ``linear_add``), or None."""
    name = _norm(norm)
    if name is None:
        return None
    n_args, n_ret = NORMS[name]
    args = decode(norm.properties["args"])
    ret = decode(norm.properties["ret"])
    if len(args) != n_args or not isinstance(args[0], Operand) or not isinstance(ret, tuple) or len(ret) != n_ret:
        return None
    total = norm.operands[args[0].index]
    if _dtype(total) != STREAM or list(norm.operands).count(total) != 1:
        return None
    maker = total.owner
    if not isinstance(maker, Operation) or len(maker.results) != 1:
        return None
    if plain_kernel(maker, "add"):
        return _add_form(maker, total)
    if linear_add and plain_kernel(maker, "linear_add") and maker.properties["dtype"].data == PROJECTION:  # type: ignore[attr-defined]
        return _linear_add_form(maker, total)
    return None


def _plain_linear(op: Operation, where: InsertPoint) -> SSAValue:
    """The bf16 ``linear(x, W, b)`` in place of ``linear_add(r, x, W, b)``: a float32 bias (autocast keeps
    linear_add's) goes through a cast to bf16 first, as the plain op's autocast narrows it."""
    _, x, w, b = kernel_values(op)  # type: ignore[misc]
    assert x is not None and w is not None  # the match checked them
    device = op.properties["device"]
    if b is not None and _dtype(b) != PROJECTION:
        cast = kernel_op_class("cast").create(
            operands=[b], result_types=[tensor_type(type_info(b.type)[0], bfloat16)],
            properties={"args": encode((Operand(0), bfloat16.np)), "ret": encode(Operand(0)), "device": device,
                        "dtype": StringAttr(_dtype(b))})
        Rewriter.insert_op(cast, where)
        b = cast.results[0]
    operands: list[SSAValue] = [x, w] + ([b] if b is not None else [])
    out_type = tensor_type(type_info(op.results[0].type)[0], bfloat16)
    linear = kernel_op_class("linear").create(
        operands=operands, result_types=[out_type],
        properties={"args": encode((Operand(0), Operand(1), Operand(2) if b is not None else None)),
                    "ret": encode(Operand(0)), "device": device, "dtype": StringAttr(PROJECTION)})
    Rewriter.insert_op(linear, where)
    return linear.results[0]


class LayerNormResidual(ModulePass):
    name = "layernorm-residual"
    linear_add: ClassVar[bool] = False  # whether a linear_add is taken apart too (numerics: module docstring)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        pos = scan.pos
        for norm, found in scan.matches(lambda o: match(o, self.linear_add)):
            maker = found.maker
            total = maker.results[0]
            # the other readers of the sum read s, which exists from the LayerNorm on
            if any(u.operation is not norm and pos.get(u.operation, -1) <= pos[norm] for u in total.uses):
                continue
            moved: list[SSAValue | None] = [found.residual]
            if found.linear is not None:
                moved.append(found.linear.results[0])
            if scan.written_between(maker, norm, moved):
                continue
            product: SSAValue
            if found.linear is not None:
                product = found.linear.results[0]
            else:
                product = _plain_linear(maker, InsertPoint.before(maker))
            args = decode(norm.properties["args"])
            x_index = args[0].index
            operands = [product if i == x_index else v for i, v in enumerate(norm.operands)] + [found.residual]
            ret = decode(norm.properties["ret"])
            n = len(norm.results)
            fused = kernel_op_class(_norm(norm) or "layer_norm").create(
                operands=operands, result_types=[*(r.type for r in norm.results), total.type],
                properties={"args": encode((*args, None, Operand(len(operands) - 1))),
                            "ret": encode((*ret, Operand(n))), "device": norm.properties["device"],
                            "dtype": norm.properties["dtype"]})
            Rewriter.insert_op(fused, InsertPoint.before(norm))
            for old, new in zip(norm.results, fused.results[:n], strict=True):
                old.replace_all_uses_with(new)
            Rewriter.erase_op(norm)
            total.replace_all_uses_with(fused.results[n])
            for o in found.replaced:
                Rewriter.erase_op(o)


class LayerNormResidualLinearAdd(LayerNormResidual):
    """``layernorm-residual`` that also turns a bf16 ``linear_add`` read by a LayerNorm into a plain bf16 GEMM
    and the residual LayerNorm: not eager's ``linear_add`` bits (module docstring), so not in the default
    pipeline."""

    name = "layernorm-residual-linear-add"
    linear_add: ClassVar[bool] = True


__all__ = ["NORMS", "LayerNormResidual", "LayerNormResidualLinearAdd", "ResidualSum", "match"]
