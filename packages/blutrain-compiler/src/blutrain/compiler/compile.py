"""``compile(fn)``: trace a whole training step once, optimize it, and replay it.

Calls of the compiled function, per signature (the shapes, dtypes and devices of its tensor
arguments, and its other non-float arguments):

1. the first ``warmup`` calls run ``fn`` eagerly (they create the optimizer's state);
2. the next call traces ``fn`` — it really runs, so it returns real results — into a
   ``blutrain``-dialect module, runs the pass pipeline and builds an executor;
3. every later call replays: it copies the tensor arguments into the program's static inputs, runs the
   host work the step registered (:func:`blutrain.tensor.capture.per_call`: the optimizers' step counts,
   learning rates and bias corrections, written into device memory) and runs the compiled program once,
   on CUDA one graph launch, with no Python of ``fn`` in between (``replay="graph"``, the default).
   A call whose float arguments differ from the last call's, or whose registered guards (an optimizer's
   betas, eps, weight decay) changed, re-runs ``fn``'s Python in probe mode first: no kernel runs,
   Python's own side effects happen as in eager mode, changed scalar kernel arguments are picked up (on
   CUDA: a new capture) and a call that takes another path raises :class:`GraphBreakError`.
   ``replay="probe"`` does that on every call: for a function with Python side effects of its own (a
   schedule stepped inside it, a counter), at the host cost of its Python each step.

A trace that holds collectives (of groups declared with ``blutrain.dist.traceable``, as the ddp, zero, tp
and cp parallel modes do) compiles as one module like any other: each collective is a ``blutrain.collective`` op
in program order, and the executor issues it there (on CUDA inside the one captured graph, on a communication
stream, joined by the first later op that touches its buffers: :mod:`blutrain.compiler.executor`).

``BLUTRAIN_DUMP_IR=dir`` writes the module after tracing and after every pass.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from xdsl.dialects.builtin import ArrayAttr, IntAttr, ModuleOp
from xdsl.passes import ModulePass

from blutrain.compiler.dialect import context
from blutrain.compiler.errors import CompilerError, GraphBreakError, TracingError
from blutrain.compiler.executor import Program
from blutrain.compiler.graph import build_module
from blutrain.compiler.registry import default_pipeline, with_remat
from blutrain.compiler.registry import passes as pass_registry
from blutrain.compiler.target import Executor, compile_target
from blutrain.compiler.trace import TraceArray, Tracer, tracing
from blutrain.tensor import capture
from blutrain.tensor.tensor import Tensor

log = logging.getLogger("blutrain.compiler")
REPLAY_MODES = ("graph", "probe")


# -- arguments and results as flat lists -----------------------------------------------------------
def _flatten(tree: Any, leaves: list[Any]) -> Any:
    """The structure of ``tree`` with each leaf replaced by its index in ``leaves``."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(_flatten(t, leaves) for t in tree)
    if isinstance(tree, dict):
        return {k: _flatten(v, leaves) for k, v in tree.items()}
    leaves.append(tree)
    return _Leaf(len(leaves) - 1)


class _Leaf:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _unflatten(spec: Any, leaves: list[Any]) -> Any:
    if isinstance(spec, _Leaf):
        return leaves[spec.index]
    if isinstance(spec, (tuple, list)):
        return type(spec)(_unflatten(s, leaves) for s in spec)
    if isinstance(spec, dict):
        return {k: _unflatten(v, leaves) for k, v in spec.items()}
    return spec


def _signature(leaves: list[Any]) -> tuple[Any, ...]:
    sig: list[Any] = []
    for x in leaves:
        if isinstance(x, Tensor):
            sig.append(("tensor", x.shape, x.dtype.name, str(x.device)))
        elif isinstance(x, float):
            sig.append("float")  # floats are data: the probe picks up their effect on kernels
        else:
            sig.append((type(x).__name__, repr(x)))
    return tuple(sig)


# -- one compiled graph ------------------------------------------------------------------------------
@dataclass
class CompileStats:
    """What one compiled graph is: its size and its two memory plans.

    ``arena_bytes``/``buffer_bytes`` are the memory-plan pass's, over the traced values (kernel results; no
    kernel scratch): planned peak against their sum. The ``alloc_*`` numbers are the CUDA executor's, over
    the allocation requests the kernels really make while the step is captured (results, scratch,
    workspaces): ``alloc_arena_bytes`` is the arena the graph runs in, ``alloc_request_bytes`` every request
    added up, ``alloc_live_peak_bytes`` the most bytes live at once (no placement needs less),
    ``alloc_pool_bytes`` what CuPy's caching pool held for the same run, ``alloc_fallbacks`` the requests the
    arena did not serve. They are 0 on the CPU and for a step that runs without a graph. ``collectives``: the
    collectives the step issues (every one inside the graph). ``recomputed``: the values the ``rematerialize``
    pass makes again before their backward readers (0 without the pass).
    """

    traced_ops: int
    ops: int
    fused_regions: int
    arena_bytes: int
    buffer_bytes: int
    device: str
    alloc_arena_bytes: int = 0
    alloc_request_bytes: int = 0
    alloc_live_peak_bytes: int = 0
    alloc_pool_bytes: int = 0
    alloc_requests: int = 0
    alloc_fallbacks: int = 0
    collectives: int = 0
    recomputed: int = 0


class CompiledGraph:
    """The trace, the optimized module and the executor of one signature."""

    def __init__(self, owner: CompiledFunction, tracer: Tracer, module: ModuleOp, traced_module: str,
                 out_spec: Any, out_leaves: list[Any], tensor_positions: list[int], dynamic: frozenset[int]) -> None:
        self.owner = owner
        self.tracer = tracer
        self.module = module
        self.traced_ir = traced_module
        self.out_spec = out_spec
        self.out_leaves = out_leaves  # vid for traced tensors, the Python value otherwise
        self.tensor_positions = tensor_positions
        self.dynamic = dynamic
        self.merged = {int(a.data) for a in _merged(module)}
        device = tracer.device or "cpu"
        self.device = device
        self.program = Program(module, device, {ev.uid: ev.call for ev in tracer.events
                                                if ev.kind == "collective" and ev.call is not None})
        inputs = [tracer.concrete[v] for v in tracer.inputs]
        state = [tracer.concrete[v] for v in tracer.state_order]
        self.executor: Executor = compile_target(device).executor(self.program, inputs, state)
        ops = next(iter(module.body.block.ops)).regions[0].block.ops
        self._stats = CompileStats(
            traced_ops=len(tracer.events), ops=sum(1 for _ in ops), fused_regions=sum(1 for o in ops
                                                                                     if o.name == "blutrain.fused"),
            arena_bytes=_attr(module, "blutrain.arena_bytes"), buffer_bytes=_attr(module, "blutrain.buffer_bytes"),
            device=device, collectives=self.program.collective_count,
            recomputed=_attr(module, "blutrain.recomputed"))

    @property
    def stats(self) -> CompileStats:
        """The graph's numbers, with the executor's arena as its last capture left it."""
        r = self.executor.report
        if r is None:
            return replace(self._stats)
        return replace(self._stats, alloc_arena_bytes=r.arena_bytes, alloc_request_bytes=r.request_bytes,
                       alloc_live_peak_bytes=r.live_peak_bytes, alloc_pool_bytes=r.pool_bytes,
                       alloc_requests=r.requests, alloc_fallbacks=r.fallbacks)

    def close(self) -> None:
        """Give the executor's memory back now (its arena and pool on CUDA); the graph cannot run after."""
        self.executor.close()

    def replay_from(self, leaves: list[Any], outputs: list[Any]) -> None:
        """What a replay without Python needs from the traced call: its float arguments, the host work it
        registered, and its outputs' dtypes and devices (tensors) or values (anything else)."""
        self.host_args = _host_args(leaves, self.tensor_positions)
        self.per_calls = list(self.tracer.per_calls)
        self.out_meta = [(x.dtype, x.device) if isinstance(x, Tensor) else x for x in outputs]
        self.replays = 0  # calls that ran no Python of the function
        self.probes = 0  # calls that re-ran its Python in probe mode

    def replayable(self, leaves: list[Any]) -> bool:
        """May this call run without the function's Python: same float arguments as the last call, every
        registered guard unchanged."""
        return (self.owner.replay == "graph" and _host_args(leaves, self.tensor_positions) == self.host_args
                and all(guard() == value for _, guard, value in self.per_calls))

    def run(self, leaves: list[Any]) -> Any:
        tensors: list[Tensor] = [leaves[i] for i in self.tensor_positions]
        if self.replayable(leaves):
            for host_work, _, _ in self.per_calls:
                host_work()
            results = self._execute({}, [t.array for t in tensors])
            self.replays += 1
            by_vid = dict(zip(self.program_output_vids(), results, strict=True))
            final = [Tensor.from_array(by_vid[v], *meta) if isinstance(v, int) else meta
                     for v, meta in zip(self.out_leaves, self.out_meta, strict=True)]
            return _unflatten(self.out_spec, final)
        probe = Tracer("probe", self.tracer)
        # no data but the call's own input, for host-side argument checks
        proxies = [TraceArray(self.tracer.values[vid], host=t.array)
                   for t, vid in zip(tensors, self.tracer.inputs, strict=True)]
        with capture.substitute_arrays(tensors, proxies), tracing(probe):
            out = self.owner.fn(*self.owner_args(leaves))
        if probe.cursor != len(self.tracer.events):
            raise GraphBreakError(f"this call ran {probe.cursor} ops, the traced call {len(self.tracer.events)}; the "
                                  "compiled function must take the same path on every call")
        self.probes += 1
        # the next calls replay with this call's arguments and guards (and the probe's host work: the same
        # steps of the same objects)
        self.host_args = _host_args(leaves, self.tensor_positions)
        self.per_calls = probe.per_calls
        return self._outputs(out, self._execute(probe.changed, [t.array for t in tensors]))

    def _execute(self, changed: dict[int, tuple[Any, ...]], inputs: list[Any]) -> list[Any]:
        """Run the compiled program on ``inputs``, with the scalars a probe found ``changed``."""
        if changed:
            for uid, template in changed.items():
                if not self.program.update(uid, template) and uid in self.merged:
                    raise CompilerError(f"traced op {uid} was merged with an identical op by CSE, and its scalar "
                                        "arguments changed since; compile with passes that leave out 'cse'")
            self.executor.updated()
        return self.executor.run(inputs)

    def ir(self) -> str:
        """The optimized module as MLIR text."""
        return str(self.module)

    def owner_args(self, leaves: list[Any]) -> tuple[Any, ...]:
        return tuple(_unflatten(self.owner.arg_spec, leaves))

    def _outputs(self, probe_out: Any, results: list[Any]) -> Any:
        leaves: list[Any] = []
        _flatten(probe_out, leaves)
        by_vid = dict(zip(self.program_output_vids(), results, strict=True))
        final: list[Any] = []
        for x in leaves:
            if isinstance(x, Tensor) and isinstance(x.array, TraceArray):
                final.append(Tensor.from_array(by_vid[x.array.vid], x.dtype, x.device))
            else:
                final.append(x)
        return _unflatten(self.out_spec, final)

    def program_output_vids(self) -> list[int]:
        return [v for v in self.out_leaves if isinstance(v, int)]


def _host_args(leaves: list[Any], tensor_positions: list[int]) -> list[str]:
    """The call's float arguments, exactly (the other non-tensor arguments are in the signature)."""
    skip = set(tensor_positions)
    return [x.hex() for i, x in enumerate(leaves) if i not in skip and isinstance(x, float)]


def _merged(module: ModuleOp) -> list[IntAttr]:
    a = module.attributes.get("blutrain.merged")
    return [x for x in a.data if isinstance(x, IntAttr)] if isinstance(a, ArrayAttr) else []


def _attr(module: ModuleOp, name: str) -> int:
    a = module.attributes.get(name)
    return int(a.data) if isinstance(a, IntAttr) else 0


def _dump(directory: str | None, index: int, name: str, module: ModuleOp, sig_index: int | str) -> None:
    if not directory:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"graph{sig_index}_{index:02d}_{name}.mlir").write_text(str(module))


def run_pipeline(module: ModuleOp, names: Sequence[str], dump_dir: str | None = None,
                 sig_index: int | str = 0) -> None:
    """Run the passes ``names`` (from the pass registry) on ``module`` in order."""
    registry = pass_registry()
    ctx = context()
    _dump(dump_dir, 0, "traced", module, sig_index)
    for i, name in enumerate(names, 1):
        found = registry.get(name)
        p: ModulePass = found() if isinstance(found, type) else found
        p.apply(ctx, module)
        _dump(dump_dir, i, name, module, sig_index)
    module.verify()


class CompiledFunction:
    """The callable :func:`compile` returns; ``ir()`` shows the compiled module as MLIR text."""

    def __init__(self, fn: Callable[..., Any], warmup: int = 1, passes: Sequence[str] | None = None,
                 replay: str = "graph", remat: bool | None = None) -> None:
        if not callable(fn):
            raise CompilerError(f"compile: expected a callable, got {type(fn).__name__}")
        if not isinstance(warmup, int) or warmup < 0:
            raise CompilerError(f"compile: warmup must be an int >= 0, got {warmup!r}")
        if replay not in REPLAY_MODES:
            raise CompilerError(f"compile: replay must be one of {', '.join(map(repr, REPLAY_MODES))}, got {replay!r}")
        if remat is not None and not isinstance(remat, bool):
            raise CompilerError(f"compile: remat must be True, False or None (the pipeline as it is), got {remat!r}")
        self.fn = fn
        self.replay = replay
        self.warmup = warmup
        pipeline = tuple(passes) if passes is not None else default_pipeline()
        self.pipeline = pipeline if remat is None else with_remat(pipeline, remat)
        self.graphs: dict[tuple[Any, ...], CompiledGraph] = {}
        self.calls: dict[tuple[Any, ...], int] = {}
        self.arg_spec: Any = None
        self.last: CompiledGraph | None = None
        self.traces = 0

    def __call__(self, *args: Any) -> Any:
        leaves: list[Any] = []
        self.arg_spec = _flatten(args, leaves)
        sig = _signature(leaves)
        n = self.calls.get(sig, 0)
        self.calls[sig] = n + 1
        if n < self.warmup:
            return self.fn(*args)
        graph = self.graphs.get(sig)
        if graph is None:
            return self._trace(sig, leaves, frozenset())
        out = graph.run(leaves)
        self.last = graph
        return out

    def _trace(self, sig: tuple[Any, ...], leaves: list[Any], dynamic: frozenset[int]) -> Any:
        log.debug("blutrain.compiler: tracing %s for signature %s", getattr(self.fn, "__name__", "fn"), sig)
        tracer = Tracer()
        positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        inputs = [leaves[i] for i in positions]
        with tracing(tracer), capture.substitute_arrays(inputs, [tracer.add_input(t.array) for t in inputs]):
            out = self.fn(*_unflatten(self.arg_spec, leaves))
        out_leaves: list[Any] = []
        out_spec = _flatten(out, out_leaves)
        markers: list[Any] = []
        vids: list[int] = []
        real: list[Any] = []
        for x in out_leaves:
            if isinstance(x, Tensor) and isinstance(x.array, TraceArray):
                markers.append(x.array.vid)
                vids.append(x.array.vid)
                real.append(Tensor.from_array(x.array.concrete.copy(), x.dtype, x.device))
            elif isinstance(x, Tensor):
                raise TracingError("compile: the function returned a tensor it did not compute (an input or a "
                                   "parameter); return computed tensors only")
            else:
                markers.append(None)
                real.append(x)
        self.traces += 1
        module = build_module(tracer, vids, dynamic)
        traced_text = str(module)
        run_pipeline(module, self.pipeline, os.environ.get("BLUTRAIN_DUMP_IR"), self.traces - 1)
        graph = CompiledGraph(self, tracer, module, traced_text, out_spec, markers, positions, dynamic)
        graph.replay_from(leaves, out_leaves)
        # the executors have their static inputs: from here on the graph needs no array of the traced call
        tracer.release()
        del out, out_leaves
        self.graphs[sig] = graph
        self.last = graph
        stats = graph.stats
        log.debug("blutrain.compiler: %d traced ops → %d ops, %d fused regions; traced values: arena %d bytes "
                  "(unplanned %d); executor: arena %d bytes (requests %d, CuPy's pool %d)", stats.traced_ops,
                  stats.ops, stats.fused_regions, stats.arena_bytes, stats.buffer_bytes, stats.alloc_arena_bytes,
                  stats.alloc_request_bytes, stats.alloc_pool_bytes)
        return _unflatten(out_spec, real)

    # -- inspection --------------------------------------------------------------------------------
    def _graph(self) -> CompiledGraph:
        if self.last is None:
            raise CompilerError("nothing is compiled yet: call the compiled function first (the first "
                                f"{self.warmup} call(s) run eagerly, the next one traces)")
        return self.last

    def ir(self) -> str:
        """The optimized module of the most recent signature, as MLIR text."""
        return self._graph().ir()

    def traced_ir(self) -> str:
        """The module as traced, before any pass."""
        return self._graph().traced_ir

    @property
    def stats(self) -> CompileStats:
        return self._graph().stats

    def reset(self) -> None:
        """Forget every compiled graph (e.g. after replacing the model's parameters), giving back the memory
        their executors hold at once."""
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self.calls.clear()
        self.last = None


def compile(fn: Callable[..., Any], *, warmup: int = 1, passes: Sequence[str] | None = None,
            replay: str = "graph", remat: bool | None = None) -> CompiledFunction:
    """Compile ``fn`` (e.g. a training step: forward, ``backward()``, ``optimizer.step()``, ``zero_grad()``).

    ``warmup`` eager calls come first (optimizers create their state on their first step); the next
    call traces; later calls replay. ``passes`` names the pipeline (default: DCE, CSE, elementwise
    fusion, kernel selection, in-place analysis and memory planning).

    ``replay="graph"`` (default): a replay runs the kernels, the host work the step registered (the
    optimizers' step counts and per-step scalars) and its collectives, and no other Python of ``fn``; a
    Python side effect inside ``fn`` (a schedule stepped there, a counter, a print) happens on the traced
    call only, and so do the argument checks that read an input's values (token ids within the embedding).
    Keep those outside ``fn``, or pass ``replay="probe"``, which re-runs ``fn``'s Python (with no kernel) on
    every call to pick them up, to run those checks and to check that the call takes the traced path.

    ``remat=True`` adds the ``rematerialize`` pass to the pipeline (before kernel selection): cheap forward values
    that the backward reads much later (a SwiGLU's or a norm's output, autocast's bf16 copy of a weight) are made
    again right before their backward reader from values alive there anyway, which lowers the step's peak memory
    for a pass over those values; ``False`` leaves it out; ``None`` (default) runs the pipeline as it is (the
    default pipeline has no ``rematerialize`` today).
    """
    return CompiledFunction(fn, warmup=warmup, passes=passes, replay=replay, remat=remat)


__all__ = ["CompileStats", "CompiledFunction", "CompiledGraph", "compile", "run_pipeline"]
