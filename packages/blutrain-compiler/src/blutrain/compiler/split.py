"""A trace with collectives, cut into parts that compile on their own and run with the collectives between.

A collective (recorded through a group declared with ``blutrain.dist.traceable``, see
:meth:`blutrain.compiler.trace.Tracer.host_call`) is no kernel of any graph: on a GPU it runs on the
communicator's terms, on the CPU through MPI. So a trace holding collectives is cut at each of them;
the events between two collectives form one *part*, a trace of its own that is built into a module,
optimized and executed like any other (on CUDA: one graph per part). A call then runs part,
collectives, part, ... in the traced order.

What crosses a cut is whole buffers, never views: a part's inputs are the buffers made before it
(by earlier parts, or the function's inputs) that it uses, its outputs the buffers it made or took in
that a later collective, part or the function's result uses; a view used across a cut is made again
in the part that uses it. State (parameters, optimizer state, gradient buckets) is the model's own
memory in every part and in every collective, so it never crosses. The executor copies inputs into
its static buffers and returns copies of outputs: each cut costs a copy of the buffers live across
it (a cut inside backward: the activations backward has still to consume, and the gradients made so far).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from blutrain.compiler.compile import CompiledGraph, CompileStats, run_pipeline
from blutrain.compiler.dialect import Operand
from blutrain.compiler.errors import CompilerError, TracingError
from blutrain.compiler.executor import strided_view
from blutrain.compiler.graph import build_module
from blutrain.compiler.trace import Event, Tracer, Value
from blutrain.tensor.backend import get_backend

if TYPE_CHECKING:
    from blutrain.compiler.compile import CompiledFunction


@dataclass
class Part:
    """The events between two cuts, as a trace of their own, and the collectives that follow them."""

    trace: Tracer
    inputs: list[int]  # buffers (root vids) made before the part, in the order its module takes them
    outputs: list[int]  # buffers it returns: needed after it
    after: list[Event] = field(default_factory=list)
    done: list[int] = field(default_factory=list)  # buffers nothing after the part and its collectives uses


def _refs(ev: Event) -> list[int]:
    return [*ev.operands, *ev.results]


def cut(tracer: Tracer, outputs: list[int]) -> tuple[list[Event], list[Part]]:
    """``tracer``'s events cut at its collectives, ``outputs`` being the vids the function returns: the
    collectives before the first kernel (on the function's inputs and state), then the parts, each with
    events and followed by the collectives up to the next part."""
    values = tracer.values
    events = tracer.events
    end = len(events)
    state = tracer.state_vids
    made: dict[int, int] = {v: -1 for v in tracer.inputs}  # vid → index of the event that made it
    last: dict[int, int] = {}  # buffer (root vid) → index of the last event that refers to it
    for i, ev in enumerate(events):
        for v in ev.results:
            made[v] = i
        for v in _refs(ev):
            last[values[v].root] = i
    for v in outputs:
        last[values[v].root] = end
    # the spans [start, stop) of events between collectives, with the collectives after each
    before: list[Event] = []
    spans: list[tuple[int, int, list[Event]]] = []
    start = 0
    for i, ev in enumerate(events):
        if ev.kind != "collective":
            continue
        if i > start:
            spans.append((start, i, []))
        (spans[-1][2] if spans else before).append(ev)
        start = i + 1
    if start < end:
        spans.append((start, end, []))
    parts: list[Part] = []
    uid = end  # made-again views get uids after every traced one
    for k, (start, stop, after) in enumerate(spans):
        following = spans[k + 1][0] if k + 1 < len(spans) else end  # the function's outputs stay
        inputs: list[int] = []
        used_state: set[int] = set()
        remade: list[Event] = []
        seen: set[int] = set()
        for ev in events[start:stop]:
            for v in ev.operands:
                if v in seen or start <= made.get(v, -2) < stop:
                    continue
                seen.add(v)
                root = values[v].root
                if root in state:
                    used_state.add(root)
                elif root not in inputs:
                    inputs.append(root)
                if v != root:  # a view made before the cut: made again from its buffer here
                    val = values[v]
                    remade.append(Event(uid, "view", "view", tracer.device or "cpu", val.dtype.name,
                                        (Operand(0), val.offset, val.shape, val.strides), [root], [v], Operand(0)))
                    uid += 1
        # what the part changed: the buffers it made, and those it took in and wrote (others stay live as
        # they were, without a copy out)
        changed = {v for ev in events[start:stop] if ev.kind == "kernel" for v in ev.results}
        changed |= {values[ev.operands[i]].root for ev in events[start:stop] for i in ev.writes}
        outs = [r for r in sorted(changed - state) if last.get(r, -1) >= stop]
        part_trace = Tracer()
        # a computed buffer that crosses the cut is a static input of this part: the trace did not hold its array,
        # so its executor gets a template of its layout (dropped again once the executor has its own buffer)
        concrete = list(tracer.concrete)
        for v in inputs:
            if concrete[v] is None:
                concrete[v] = layout_template(values[v], tracer.device or "cpu")
        part_trace.values, part_trace.concrete, part_trace.device = values, concrete, tracer.device
        part_trace.inputs = inputs
        part_trace.state_order = [v for v in tracer.state_order if v in used_state]
        part_trace.state_vids = set(part_trace.state_order)
        part_trace.events = [*remade, *events[start:stop]]
        done = [r for r, i in last.items() if r not in state and i < following and (i >= start or k == 0)]
        parts.append(Part(part_trace, inputs, outs, after, sorted(done)))
    return before, parts


def layout_template(value: Value, device: str) -> Any:
    """An uninitialised array of ``value``'s shape and dtype on ``device`` in its traced memory layout: a kernel's
    result is dense in some order of its dimensions (a ``cat`` of transposed pieces is permuted), and the buffer
    that crosses a cut must keep that layout for the views made of it."""
    xp = get_backend(device).xp
    order = sorted(range(len(value.shape)), key=lambda d: -value.strides[d])
    dense = xp.empty([value.shape[d] for d in order], value.dtype.np)
    return dense.transpose([order.index(d) for d in range(len(order))])


def operand_array(tracer: Tracer, vid: int, live: dict[int, Any]) -> Any:
    """The real array of value ``vid`` at a cut: its state buffer or its live buffer, viewed as traced."""
    val = tracer.values[vid]
    base = tracer.concrete[val.root] if val.root in tracer.state_vids else live[val.root]
    return base if vid == val.root else strided_view(base, val.offset, val.shape, val.strides)


class SplitGraph(CompiledGraph):
    """The compiled graph of a trace that holds collectives: one :class:`CompiledGraph` per part (each
    only run through its executor), the collectives issued between them.

    Calls replay (or are probed) as any graph's (:meth:`CompiledGraph.run`); ``module``, ``program`` and
    ``executor`` are the first part's, ``stats`` the parts' summed, ``ir()`` every part's module with a
    comment line per collective.
    """

    def __init__(self, owner: CompiledFunction, tracer: Tracer, outputs: list[int], out_spec: Any,
                 out_leaves: list[Any], tensor_positions: list[int], dynamic: frozenset[int]) -> None:
        # not CompiledGraph.__init__: there is no one module; the parts are graphs of their own
        self.owner = owner
        self.tracer = tracer
        self.out_spec = out_spec
        self.out_leaves = out_leaves
        self.tensor_positions = tensor_positions
        self.dynamic = dynamic
        self.device = tracer.device or "cpu"
        self.before, self.pieces = cut(tracer, outputs)
        if not self.pieces:
            raise TracingError("compile: the function runs collectives and no kernel; there is nothing to compile")
        self.parts: list[CompiledGraph] = []
        texts: list[str] = []
        for k, piece in enumerate(self.pieces):
            module = build_module(piece.trace, piece.outputs, dynamic)
            texts.append(str(module))
            run_pipeline(module, owner.pipeline, os.environ.get("BLUTRAIN_DUMP_IR"), f"{owner.traces - 1}_part{k}")
            self.parts.append(CompiledGraph(owner, piece.trace, module, texts[-1], None, piece.outputs,
                                            [], dynamic))
            for v in piece.inputs:  # the executor copied the layout templates into its own static buffers
                if v not in tracer.state_vids:
                    piece.trace.concrete[v] = None
        self.collectives = len(self.before) + sum(len(p.after) for p in self.pieces)
        self.traced_ir = self._joined(texts)
        self.merged = {uid for p in self.parts for uid in p.merged}
        self.module, self.program, self.executor = self.parts[0].module, self.parts[0].program, self.parts[0].executor

    @property
    def stats(self) -> CompileStats:
        """Every number summed over the parts (their arenas all exist at once); ``traced_ops`` counts the
        collectives too."""
        per = [p.stats for p in self.parts]
        sums = {f.name: sum(getattr(s, f.name) for s in per) for f in fields(CompileStats)
                if isinstance(getattr(per[0], f.name), int)}
        sums["traced_ops"] = len(self.tracer.events)
        return CompileStats(**sums, device=self.device)

    def ir(self) -> str:
        return self._joined([str(p.module) for p in self.parts])

    def _joined(self, texts: list[str]) -> str:
        def lines(collectives: list[Event]) -> list[str]:
            return [f"// collective {ev.op} on %{', %'.join(map(str, ev.operands))}" for ev in collectives]

        out = lines(self.before)
        for k, (text, piece) in enumerate(zip(texts, self.pieces, strict=True)):
            out += [f"// part {k}", text, *lines(piece.after)]
        return "\n".join(out)

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def _execute(self, changed: dict[int, tuple[Any, ...]], inputs: list[Any]) -> list[Any]:
        """Parts and collectives in the traced order; each buffer that crosses a cut is held in ``live``."""
        for uid, template in changed.items():
            part = next((p for p in self.parts if p.program.update(uid, template)), None)
            if part is not None:
                part.executor.updated()
            elif uid in self.merged:
                raise CompilerError(f"traced op {uid} was merged with an identical op by CSE, and its scalar "
                                    "arguments changed since; compile with passes that leave out 'cse'")
        tracer = self.tracer
        live: dict[int, Any] = dict(zip(tracer.inputs, inputs, strict=True))

        def issue(collectives: list[Event]) -> None:
            for ev in collectives:
                assert ev.call is not None
                ev.call([operand_array(tracer, v, live) for v in ev.operands])

        issue(self.before)
        for part, piece in zip(self.parts, self.pieces, strict=True):
            live.update(zip(piece.outputs, part.executor.run([live[r] for r in piece.inputs]), strict=True))
            issue(piece.after)
            for r in piece.done:
                live.pop(r, None)
        return [operand_array(tracer, v, live).copy() for v in self.program_output_vids()]


__all__ = ["Part", "SplitGraph", "cut", "operand_array"]
