"""Multi-tensor cast: the casts of a step's arguments to one dtype become one ``cast_multi_tensor`` at the
start of the step.

Under autocast each linear layer rounds its float32 weight and bias to bf16 as it reads them, so a compiled
GPT-2 124M step without this pass has 72 small cast kernels in its forward (each launch-bound, far from the
copy bandwidth, and followed by the gap between two graph nodes; docs/benchmarks.md). Their sources are the
step's arguments (parameters, inputs), which hold their values from the step's start, so the casts can all run
there, in one launch (casts.cu's multi-tensor kernels on cuda). Autograd saves those bf16 copies for the
backward's GEMMs anyway, so making them at the start does not raise the peak.

The pattern: a plain ``cast`` kernel (one result, no in-place write, no changing scalars) between floating
dtypes whose operand is a block argument itself (not a view of one) that no op before the cast writes (a
parameter the optimizer updated earlier in the step: converted at the start, the cast would see the old
values). Such casts of one device, source dtype and target dtype are gathered in program order; two or more
become one ``cast_multi_tensor`` before the step's first op, where the registry has that kernel for the
device and source dtype. Its kernels give each array the bits the cast kernel gives it, so the compiled step
stays eager's bit for bit.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import BlockArgument, Operation
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import KernelOp, Operand, decode, encode, type_info
from blutrain.compiler.graph import body
from blutrain.compiler.passes.patterns import Scan, plain_kernel, written_between
from blutrain.tensor.dtype import FLOATING_NAMES, as_dtype
from blutrain.tensor.errors import KernelNotFoundError
from blutrain.tensor.kernel import kernels

KERNEL = "cast_multi_tensor"

Group = tuple[str, str, str]  # (device, source dtype, target dtype)


def match(scan: Scan, op: Operation) -> Group | None:
    """The group of a cast of an argument that the step has not written before it, or None."""
    if not plain_kernel(op, "cast") or len(op.operands) != 1:
        return None
    src = op.operands[0]
    if not isinstance(src, BlockArgument):
        return None
    source, target = type_info(src.type)[1].name, type_info(op.results[0].type)[1].name
    if source not in FLOATING_NAMES or target not in FLOATING_NAMES or source == target:
        return None
    if written_between(scan.info, scan.ops, -1, scan.pos[op], [src]):
        return None
    return op.properties["device"].data, source, target  # type: ignore[attr-defined]


def _available(device: str, dtype: str) -> bool:
    try:
        kernels().lookup(KERNEL, device, as_dtype(dtype))
    except KernelNotFoundError:
        return False
    return True


class MultiTensorCast(ModulePass):
    name = "multi-tensor-cast"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        groups: dict[Group, list[Operation]] = {}
        for o in scan.ops:
            group = match(scan, o)
            if group is not None:
                groups.setdefault(group, []).append(o)
        block = body(op)
        for (device, dtype, _), casts in groups.items():
            if len(casts) < 2 or not _available(device, dtype):
                continue
            to = decode(casts[0].properties["args"])[1]
            multi = KernelOp.create(
                operands=[c.operands[0] for c in casts], result_types=[c.results[0].type for c in casts],
                properties={"op": StringAttr(KERNEL), "args": encode(([Operand(i) for i in range(len(casts))], to)),
                            "ret": encode(tuple(Operand(i) for i in range(len(casts)))),
                            "device": StringAttr(device), "dtype": StringAttr(dtype)})
            first = block.first_op
            assert first is not None  # the block holds the casts
            Rewriter.insert_op(multi, InsertPoint.before(first))
            for cast, result in zip(casts, multi.results, strict=True):
                cast.results[0].replace_all_uses_with(result)
                Rewriter.erase_op(cast)


__all__ = ["MultiTensorCast", "match"]
