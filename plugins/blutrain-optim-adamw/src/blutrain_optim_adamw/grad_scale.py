"""The compiler pass ``adamw-grad-scale``: the global-norm clip's rescale handed to AdamW: a ``scale_multi_tensor``
of gradients that only ``adamw_multi_tensor`` reads after it goes, and each of those AdamW calls takes the clip
coefficient as its ``grad_scale`` operand. The plugin registers it through ``blutrain_register_passes`` to run
before ``inplace-aliasing`` in the compiler's default pipeline (after ``copy-elision``, which only drops copies).

``blutrain.optim.clip_grad_norm_`` scales every gradient in place by a 0-d device coefficient; the optimizer
then reads every gradient again: in a GPT-2 124M step the scale alone reads and writes 124 M float32 elements
just before AdamW reads them (docs/benchmarks.md has the timings). The AdamW kernels (the plugin's CPU kernel and
``blutrain.kernels.cuda``'s) multiply each gradient element by ``grad_scale`` as they read it and round the
product to the gradient's dtype, as the in-place scale stores it: the update is eager's bit for bit, and the
scale's pass over memory is gone.

The pattern, for one ``scale_multi_tensor`` (a plain multi-tensor call: a list of tensors and the 0-d
coefficient, writing exactly the list):

- every scaled tensor is a buffer the step computed (not a view, not an argument of the step: a parameter's
  ``.grad`` kept across calls by ``zero_grad(set_to_none=False)`` or never zeroed is state, which the caller sees
  after the call, and would see unscaled) and is scaled once;
- after the scale, nothing but ``adamw_multi_tensor`` ops reads the tensor or a view of it, each reading it as
  a gradient (not writing it), and the step does not return it (with ``zero_grad()`` at the end, as the
  trainer's and the benchmark's steps do, a gradient dies inside the step);
- each such AdamW call reads gradients of this scale only (one coefficient for all of them), has no
  ``grad_scale`` yet and has the coefficient's dtype; one AdamW call per parameter group and bucket is the
  usual case, each covering a subset of the scaled tensors; a scaled tensor that nothing reads afterwards
  (a parameter the optimizer does not hold) needs no scaling either;
- no op between the scale and an AdamW call writes the coefficient.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from blutrain.compiler import (
    Operand,
    Scan,
    ViewOp,
    decode,
    encode,
    is_kernel,
    kernel_name,
    kernel_op_class,
    type_info,
    written_operands,
)

SCALE = "scale_multi_tensor"
ADAMW = "adamw_multi_tensor"
ADAMW_ARGS = 9  # params, grads, exp_avgs, exp_avg_sqs, step_scalars, beta1, beta2, eps, weight_decay


def scaled(op: Operation) -> tuple[list[SSAValue], SSAValue] | None:
    """(the scaled tensors, the coefficient) of a plain ``scale_multi_tensor`` call: ``([t0, t1, ...], c)``
    writing exactly the list."""
    if not is_kernel(op) or kernel_name(op) != SCALE or "dynamic" in op.properties or op.results:
        return None
    args = decode(op.properties["args"])
    if (len(args) != 2 or not isinstance(args[0], list) or not isinstance(args[1], Operand)
            or not all(isinstance(a, Operand) for a in args[0])):
        return None
    tensors = [op.operands[a.index] for a in args[0]]
    if set(written_operands(op)) != {a.index for a in args[0]}:
        return None
    coef = op.operands[args[1].index]
    if type_info(coef.type)[0] != () or coef in tensors:
        return None
    return tensors, coef


def _grads(adamw: Operation) -> list[SSAValue] | None:
    """The gradients a plain ``adamw_multi_tensor`` call without ``grad_scale`` reads, or None."""
    if not is_kernel(adamw) or kernel_name(adamw) != ADAMW or "dynamic" in adamw.properties:
        return None
    args = decode(adamw.properties["args"])
    if len(args) != ADAMW_ARGS or not isinstance(args[1], list) or not all(isinstance(a, Operand) for a in args[1]):
        return None
    if {a.index for a in args[1]} & set(written_operands(adamw)):
        return None
    return [adamw.operands[a.index] for a in args[1]]


def _readers(tensor: SSAValue) -> list[tuple[Operation, SSAValue]]:
    """Every (op, value it reads) that reaches ``tensor``'s memory: its uses and those of views of it."""
    out: list[tuple[Operation, SSAValue]] = []
    todo = [tensor]
    while todo:
        v = todo.pop()
        for use in v.uses:
            if isinstance(use.operation, ViewOp):
                todo.extend(use.operation.results)
            else:
                out.append((use.operation, v))
    return out


def adamw_readers(scan: Scan, scale: Operation, tensors: list[SSAValue], coef: SSAValue) -> list[Operation] | None:
    """The AdamW calls that take over ``scale``'s work, in order, or None if the pattern does not hold."""
    if len(set(tensors)) != len(tensors):
        return None  # a tensor listed twice is scaled twice
    where = scan.pos[scale]
    adamws: dict[Operation, None] = {}
    for t in tensors:
        if not isinstance(t.owner, Operation) or isinstance(t.owner, ViewOp):
            return None  # an argument (state: the caller sees it after the step) or a view of another buffer
        for op, v in _readers(t):
            at = scan.pos.get(op)
            if at is None:
                return None  # an op this pass made: not looked at
            if at <= where:
                continue  # the clip's norm, backward's accumulation, the scale itself: before it
            if v is not t:
                return None
            grads = _grads(op)
            if grads is None or t not in grads:
                return None  # another reader, the step's return among them
            adamws[op] = None
    mine = set(tensors)
    dtype = type_info(coef.type)[1].name
    for adamw in adamws:
        if not mine.issuperset(_grads(adamw) or ()) or adamw.properties["dtype"].data != dtype:  # type: ignore[attr-defined]
            return None  # one coefficient for all of its gradients, in their dtype
        if scan.written_between(scale, adamw, [coef]):
            return None
    return sorted(adamws, key=lambda o: scan.pos[o])


def with_grad_scale(adamw: Operation, coef: SSAValue) -> Operation:
    """``adamw`` with ``coef`` as its 10th argument, ``grad_scale``: a new last operand."""
    args = (*decode(adamw.properties["args"]), Operand(len(adamw.operands)))
    properties = dict(adamw.properties)
    properties["args"] = encode(args)
    return kernel_op_class(ADAMW).create(operands=[*adamw.operands, coef], result_types=[],
                                         properties=properties)


class AdamWGradScale(ModulePass):
    name = "adamw-grad-scale"
    runs_before = "inplace-aliasing"  # first: on the traced step as recorded, before any pass rewrites it

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        scan = Scan(op)
        for scale, (tensors, coef) in scan.matches(scaled):
            adamws = adamw_readers(scan, scale, tensors, coef)
            if adamws is None:
                continue
            for adamw in adamws:
                Rewriter.replace_op(adamw, with_grad_scale(adamw, coef))
            Rewriter.erase_op(scale)


__all__ = ["ADAMW", "SCALE", "AdamWGradScale", "adamw_readers", "scaled", "with_grad_scale"]
