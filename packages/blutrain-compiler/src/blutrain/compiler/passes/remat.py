"""Rematerialization: a value that a cheap op makes in the forward and that a backward op reads much later is
made again right before that reader, from inputs that are alive there anyway, instead of being held in between.

A training step keeps what its backward reads. Some of that is cheap to make again from other values the
backward keeps too: an autocast bf16 copy of a weight (the backward GEMM reads it; the float32 weight is held
all step), Llama's SwiGLU output ``h = silu(a) · b`` (the down projection's weight gradient reads it;
``swiglu``'s backward keeps ``a`` and ``b``), an RMSNorm's or LayerNorm's output (the next GEMM's weight gradient
reads it; the norm's backward keeps its input, weight and statistics). Holding such a value from the forward to
its backward reader costs its bytes over every op in between; making it again costs one pass over memory.

The rule, per op (in program order), is the one of :func:`recompute_plan`:

- the op is of a recomputable kind (:data:`RECOMPUTABLE`): elementwise ops, casts and copies, GELU and its
  relatives, ``swiglu``, a norm without a residual (its other results are per-row statistics), a fused elementwise
  region with one result; it writes nothing, its results are never written in place, it is not ``dynamic``. A
  multi-tensor cast (the weights' autocast copies, gathered at the step's start by ``multi-tensor-cast``) counts
  as the casts it stands for: each result is made again by the plain ``cast`` of its weight;
- its first result's readers fall in two groups with at least :data:`MIN_GAP` ops between them (the largest such
  gap; a reader through views of the value counts where it reads): the later readers read a copy made by the same
  op on the same operands, inserted right before the first of them (with the views they read made again on it),
  and the value dies after its last earlier reader; the copy is a candidate in turn (a value read by several
  micro-batches' forwards and backwards is split at each long gap);
- every operand of the op is alive at that reader anyway: a graph argument, or a value some op at or after the
  reader still reads (a view's buffer counts), and nothing between the op and the reader writes its memory.
  The copy then holds no buffer live longer than before, so no point of the step holds more bytes than it did
  but for the copy's per-row statistics; its buffer replaces the original's from the reader on.

Same op, same operands, same dtype: the copy has the original's bits on every device. The pass runs after CSE
(which would merge the copy back) and the folding passes, and after elementwise fusion and the multi-tensor
cast (so a copy is neither fused into a forward region nor gathered to the step's start), before kernel
selection and memory planning. Torch's min-cut partitioner (``min_cut_rematerialization_partition``) decides
the same question with a minimum cut between the joint graph's forward and backward, weighted by the bytes each
saved tensor holds, over the ops it may recompute (pointwise ops, views, cheap reductions; never GEMMs or random
ops). This pass keeps the explainable part of it: a list of cheap ops, and the rule that recomputing one saves
no new buffer for the backward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntAttr, ModuleOp
from xdsl.ir import Block, BlockArgument, Operation, SSAValue, Use
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from blutrain.compiler.dialect import CATALOGUE_OPS, FusedOp, Operand, ViewOp, decode, encode, is_kernel, kernel_name
from blutrain.compiler.graph import body
from blutrain.compiler.passes.aliasing import AliasInfo, analyse, root_of
from blutrain.compiler.passes.fusion import ELEMENTWISE
from blutrain.compiler.passes.patterns import written_between

# op kind → how many results it may have: the first is the value recomputed, any others are per-row statistics
# (a norm's mean and rstd) whose originals the backward keeps; a norm that adds a residual returns the sum too, a
# full-size result, and is not recomputed
RECOMPUTABLE: dict[str, int] = {
    **dict.fromkeys(ELEMENTWISE | {"cast", "copy", "gelu", "bias_gelu", "silu", "sigmoid", "relu", "swiglu"}, 1),
    "rms_norm": 2,
    "layer_norm": 3,
}

# a multi-tensor cast (the multi-tensor-cast pass's gathering of the weights' casts at the step's start): each of
# its results is a cast of one argument, alive all step
MULTI_CAST = "cast_multi_tensor"

# the fewest ops between a value's last earlier reader and its first later reader for a copy to be made: a value
# skipped by a few ops is held briefly; one read in the forward and again in the backward is skipped by the rest
# of the forward and the backward of the layers after it
MIN_GAP = 8


@dataclass(frozen=True)
class Plan:
    """Make result ``result`` of ``op`` again from ``operands`` right before ``ops[split]``; its readers from there
    on read the copy."""

    op: Operation
    result: int
    operands: tuple[SSAValue, ...]
    split: int
    gap: int


def recomputable(op: Operation, info: AliasInfo) -> bool:
    """Whether ``op`` is of a kind this pass makes again, with no side effect and no result written in place."""
    if isinstance(op, FusedOp):
        allowed = 1
    elif is_kernel(op):
        allowed = RECOMPUTABLE.get(kernel_name(op), 0)
        if "dynamic" in op.properties or "writes" in op.properties:
            return False
    else:
        return False
    if not 1 <= len(op.results) <= allowed or info.writes_anything(op):
        return False
    return not any(r in info.mutated for r in op.results)


def _multi_cast_sources(op: Operation) -> list[SSAValue] | None:
    """The source of each result of a ``cast_multi_tensor`` op (result i is the cast of array i), or None for
    another op."""
    if not is_kernel(op) or kernel_name(op) != MULTI_CAST or "dynamic" in op.properties or "writes" in op.properties:
        return None
    arrays, _ = decode(op.properties["args"])
    if decode(op.properties["ret"]) != tuple(Operand(i) for i in range(len(op.results))):
        return None
    return [op.operands[a.index] for a in arrays]


def recomputable_results(op: Operation, info: AliasInfo,
                         weights: bool = True) -> list[tuple[int, tuple[SSAValue, ...]]]:
    """(result index, the operands its copy reads) for each result of ``op`` this pass may make again: the first
    result of a recomputable op (from all its operands), each result of a multi-tensor cast (the cast of its one
    array, made again by the plain ``cast`` it stands for; none with ``weights`` False)."""
    sources = _multi_cast_sources(op)
    if sources is not None:
        if not weights:
            return []
        if info.writes_anything(op):
            return []
        return [(i, (src,)) for i, src in enumerate(sources) if op.results[i] not in info.mutated]
    return [(0, tuple(op.operands))] if recomputable(op, info) else []


class Liveness:
    """A block's ops in order, the last position at which each buffer is read (views count for the buffer they
    view; the step's outputs are read at the end), and what each op writes (``info``: the copies this pass makes
    write nothing, so the analysis of the block before them holds after them; ``roots``: each value's buffer,
    kept from one Liveness to the next)."""

    def __init__(self, block: Block, info: AliasInfo | None = None,
                 roots: dict[SSAValue, SSAValue] | None = None) -> None:
        self.ops = list(block.ops)
        self.pos = {o: i for i, o in enumerate(self.ops)}
        self.info = analyse(block) if info is None else info
        self.last: dict[SSAValue, int] = {}
        roots = {} if roots is None else roots
        end = len(self.ops)
        for i, o in enumerate(self.ops):
            at = end if isinstance(o, func.ReturnOp) else i
            for v in o.operands:
                root = roots.get(v)
                if root is None:
                    root = roots[v] = root_of(v)
                self.last[root] = at

    def alive_at(self, v: SSAValue, position: int) -> bool:
        """Whether ``v``'s buffer is held at ``position`` anyway: a graph argument, or read there or later."""
        root = root_of(v)
        return isinstance(root, BlockArgument) or self.last.get(root, -1) >= position


def readers(v: SSAValue) -> list[Use] | None:
    """The uses of ``v`` and of the views of it (through further views) by ops that are not views; None where the
    step returns one of them (an output is held to the end anyway)."""
    found: list[Use] = []
    for use in v.uses:
        if isinstance(use.operation, func.ReturnOp):
            return None
        if isinstance(use.operation, ViewOp):
            inner = readers(use.operation.results[0])
            if inner is None:
                return None
            found += inner
        else:
            found.append(use)
    return found


def recompute_plan(op: Operation, result: int, operands: tuple[SSAValue, ...], live: Liveness,
                   min_gap: int = MIN_GAP) -> Plan | None:
    """Where result ``result`` of ``op`` may be made again from ``operands`` (see the module's rule), or None."""
    uses = readers(op.results[result])
    if uses is None:
        return None
    positions = sorted({live.pos[u.operation] for u in uses})
    best: tuple[int, int] | None = None  # (gap, split)
    for before, after in itertools.pairwise(positions):
        gap = after - before - 1
        if gap >= min_gap and (best is None or gap > best[0]):
            best = (gap, after)
    if best is None:
        return None
    gap, split = best
    if not all(live.alive_at(v, split) for v in operands):
        return None
    if written_between(live.info, live.ops, live.pos[op], split, list(operands)):
        return None
    return Plan(op, result, operands, split, gap)


def _copy(plan: Plan) -> Operation:
    """The op that makes ``plan``'s value again as its first result: a clone of the op, or for a multi-tensor
    cast's result the plain ``cast`` of its array (the multi-tensor kernel gives each array the cast kernel's
    bits)."""
    if _multi_cast_sources(plan.op) is None:
        return plan.op.clone()
    _, to = decode(plan.op.properties["args"])
    return CATALOGUE_OPS["cast"].create(
        operands=list(plan.operands), result_types=[plan.op.results[plan.result].type],
        properties={"args": encode((Operand(0), to)), "ret": encode(Operand(0)),
                    "device": plan.op.properties["device"], "dtype": plan.op.properties["dtype"]})


def recompute(plan: Plan, live: Liveness) -> Operation:
    """Insert the copy before the plan's split reader and hand it the readers from there on (a reader through
    views of the value reads the same views of the copy, made there too)."""
    reader = live.ops[plan.split]
    copy = _copy(plan)
    Rewriter.insert_op(copy, InsertPoint.before(reader))
    original = plan.op.results[plan.result]
    moved: dict[SSAValue, SSAValue] = {original: copy.results[0]}

    def moved_value(v: SSAValue) -> SSAValue:
        if v not in moved:
            view = v.owner
            assert isinstance(view, ViewOp)  # readers() reaches the value through views only
            source = view.operands[0]
            clone = view.clone(value_mapper={source: moved_value(source)})
            Rewriter.insert_op(clone, InsertPoint.before(reader))
            moved[v] = clone.results[0]
        return moved[v]

    for use in readers(original) or []:
        if live.pos[use.operation] >= plan.split:
            use.operation.operands[use.index] = moved_value(use.operation.operands[use.index])
    return copy


def rematerialize(block: Block, min_gap: int = MIN_GAP, weights: bool = True) -> list[Plan]:
    """Apply the pass to ``block``; returns what it recomputed. Liveness is taken again after each copy: a value
    whose later readers moved to a copy is no longer alive at them. A copy is itself a candidate: a value read by
    several micro-batches' forwards and backwards (gradient accumulation) is split at each long gap in turn.
    ``weights`` False leaves the weights' autocast copies (a multi-tensor cast's results) held: activations only."""
    done: list[Plan] = []
    tried: set[tuple[Operation, int]] = set()  # (op, result) already planned or refused
    finished: set[Operation] = set()  # ops whose every result was tried
    info = analyse(block)
    roots: dict[SSAValue, SSAValue] = {}
    while True:
        live = Liveness(block, info, roots)
        plan = None
        for o in live.ops:
            if o in finished:
                continue
            for result, operands in recomputable_results(o, live.info, weights):
                if (o, result) in tried:
                    continue
                tried.add((o, result))
                plan = recompute_plan(o, result, operands, live, min_gap)
                if plan is not None:
                    break
            if plan is not None:
                break
            finished.add(o)
        if plan is None:
            return done
        recompute(plan, live)
        done.append(plan)


class Rematerialize(ModulePass):
    """The pass; the module attribute ``blutrain.recomputed`` counts the copies it made."""

    name = "rematerialize"
    weights = True  # the weights' autocast copies are made again too

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        plans = rematerialize(body(op), weights=self.weights)
        op.attributes["blutrain.recomputed"] = IntAttr(len(plans))


class RematerializeActivations(Rematerialize):
    """The pass on activations only: the weights' bf16 copies (one cast each per step, gathered at its start) stay
    held. Less memory saved than :class:`Rematerialize` (Llama-1B by the shapes: 3.95 of its 5.75 GiB) for less
    traffic (no cast of every weight again before backward). Replace ``rematerialize`` by it in a pipeline."""

    name = "rematerialize-activations"
    weights = False


__all__ = ["MIN_GAP", "MULTI_CAST", "RECOMPUTABLE", "Liveness", "Plan", "Rematerialize", "RematerializeActivations",
           "readers", "recomputable",
           "recomputable_results", "recompute", "recompute_plan", "rematerialize"]
