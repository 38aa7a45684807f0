"""The executor: a compiled module as a flat list of launches on static buffers.

:class:`Program` turns the step function's ops, in order, into launches — a registered kernel (the
one kernel selection picked), a strided view, an in-place assignment, or a generated fused kernel —
each reading and writing slots. Inputs are copied into static buffers owned by the program; state
(parameters, optimizer state) is the model's own arrays, updated in place. A slot is dropped right
after its last reader, so memory follows the liveness the planner computed.

On the CPU, :class:`CPUExecutor` runs the list. On CUDA, :class:`CUDAGraphExecutor` captures one run
of the list into a CUDA graph on its own stream, inside one planned arena (``arena.py``): a first capture
records every allocation request the kernels make and when each is freed, the requests are placed by
liveness, and the capture that is kept takes each one at its offset in an arena of the planned size (the
graph's buffers stay there, so nothing else can take them). Each call copies the inputs into their static
buffers and launches the graph once.

A collective of the step (``blutrain.collective``: a bucket's all-reduce, a reduce-scatter, a parameter
all-gather) is a launch like the others. The program knows, for each one, the first later launch that touches
one of its operands' buffers (reads or writes them): that launch *joins* it, and the launches between run beside
it. The :class:`CollectiveRunner` decides what that means: on the CPU a collective completes where it is issued
(:class:`InlineCollectives`); on CUDA (:class:`StreamCollectives`) it is forked onto a communication stream
ordered after everything before it, and the launch that joins it waits for it there, so that a bucket's
reduction runs under the rest of backward, inside the one captured graph. The collective's operand arrays are
held until the join, so the arena planner sees their buffers live until then and places nothing over them.

A kernel's Python scalar arguments are baked into the captured graph, so a call whose scalars changed
(``updated()``, counted in ``updates``) captures it again. Numbers meant to change every step (an
optimizer's lr and bias corrections) therefore live in device arrays that are graph state
(``blutrain.optim.StepScalars``): the host refills them before the launch, and one capture serves
every step.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from xdsl.dialects import func
from xdsl.dialects.builtin import IntAttr, ModuleOp
from xdsl.ir import SSAValue

from blutrain.compiler import codegen_cuda, codegen_numpy
from blutrain.compiler.arena import ALIGN, AllocationRun, ArenaReport, Placement, RecordingRun, ServingRun, place
from blutrain.compiler.dialect import (
    AssignOp,
    CollectiveOp,
    FusedOp,
    Operand,
    ViewOp,
    decode,
    is_kernel,
    kernel_name,
    type_info,
)
from blutrain.compiler.errors import CompilerError
from blutrain.compiler.graph import attr_int, body
from blutrain.tensor.backend import ARRAY_MODULES
from blutrain.tensor.dtype import as_dtype
from blutrain.tensor.kernel import kernels

log = logging.getLogger("blutrain.compiler")


def _substitute(template: Any, values: list[Any]) -> Any:
    if isinstance(template, Operand):
        return values[template.index]
    if isinstance(template, tuple):
        return tuple(_substitute(t, values) for t in template)
    if isinstance(template, list):
        return [_substitute(t, values) for t in template]
    return template


def _flat_results(ret: Any, out: Any, dest: list[Any]) -> None:
    if isinstance(ret, Operand):
        dest[ret.index] = out
    elif isinstance(ret, tuple):
        for r, o in zip(ret, out, strict=True):
            _flat_results(r, o, dest)


def strided_view(root: Any, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    """The view of ``root`` that starts ``offset`` elements after its first element."""
    xp = ARRAY_MODULES[type(root)]
    itemsize = root.dtype.itemsize
    if offset:
        if xp.__name__ == "cupy":
            return xp.ndarray(shape, root.dtype, memptr=root.data + offset * itemsize,
                              strides=tuple(s * itemsize for s in strides))
        # walk to the element at ``offset`` through root's (dense) strides, largest first
        index = [0] * root.ndim
        rest = offset
        for d in sorted(range(root.ndim), key=lambda d: -root.strides[d]):
            step = root.strides[d] // itemsize
            if step:
                index[d], rest = divmod(rest, step)
        if rest:
            raise CompilerError(f"view offset {offset} does not fall on an element of its buffer")
        root = root[tuple(slice(i, i + 1) for i in index)]
    return xp.lib.stride_tricks.as_strided(root, shape, tuple(s * itemsize for s in strides))


class CollectiveRunner(Protocol):
    """How a program's collectives run: ``issue`` starts collective ``key`` (``call`` on its operand arrays);
    ``join`` orders what runs next after it; ``join_all`` joins every collective issued and not yet joined."""

    def issue(self, key: int, call: Callable[[list[Any]], None], arrays: list[Any]) -> None: ...

    def join(self, key: int) -> None: ...

    def join_all(self) -> None: ...


class InlineCollectives:
    """Each collective completes where it is issued (the CPU: MPI calls return when they are done)."""

    def issue(self, key: int, call: Callable[[list[Any]], None], arrays: list[Any]) -> None:
        call(arrays)

    def join(self, key: int) -> None:
        pass

    def join_all(self) -> None:
        pass


class StreamCollectives:
    """Collectives forked onto a side stream of their own, joined back into the current stream.

    ``issue``: the side stream waits for everything issued before on the current stream, the call runs with the
    side stream current (a process group orders its communication after the current stream and makes it wait
    for its end), and an event marks its end. ``join``: the current stream waits for that event. Inside a stream
    capture these become the graph's edges: the collective is a branch of the graph beside the compute after it.
    Memory a collective allocates (a staging buffer) comes from ``pool`` on the side stream, never from the
    compute's allocator, whose blocks the compute after the fork may reuse while the collective still runs."""

    def __init__(self, cupy: Any, pool: Any) -> None:
        self.cupy = cupy
        self.pool = pool
        self.side = cupy.cuda.Stream(non_blocking=True)
        self.pending: dict[int, tuple[Any, list[Any]]] = {}  # key → (end event, operand arrays held until the join)

    def issue(self, key: int, call: Callable[[list[Any]], None], arrays: list[Any]) -> None:
        cuda = self.cupy.cuda
        self.side.wait_event(cuda.get_current_stream().record())
        with cuda.using_allocator(self.pool.malloc), self.side:
            call(arrays)
        self.pending[key] = (self.side.record(), arrays)

    def join(self, key: int) -> None:
        end, _ = self.pending.pop(key)
        self.cupy.cuda.get_current_stream().wait_event(end)

    def join_all(self) -> None:
        for key in list(self.pending):
            self.join(key)


class Launch:
    """One entry of the program: ``fn`` applied to the slots ``reads``, results into ``results``; first the
    collectives (their launch indices) in ``joins`` are joined."""

    __slots__ = ("fn", "frees", "joins", "kind", "reads", "results", "ret", "template", "uid")

    def __init__(self, kind: str, fn: Callable[..., Any], reads: list[int], results: list[int],
                 template: Any = None, ret: Any = None, uid: int = -1) -> None:
        self.kind = kind
        self.fn = fn
        self.reads = reads
        self.results = results
        self.template = template
        self.ret = ret
        self.uid = uid
        self.frees: list[int] = []
        self.joins: list[int] = []


class Program:
    """The launches of one compiled module, with its slots (one per SSA value). ``collectives`` maps the uid of
    each ``blutrain.collective`` op to the call that issues it on real arrays (the trace recorded it)."""

    def __init__(self, module: ModuleOp, device: str,
                 collectives: dict[int, Callable[[list[Any]], None]] | None = None) -> None:
        self.device = device
        self.runner: CollectiveRunner = InlineCollectives()
        block = body(module)
        slot: dict[SSAValue, int] = {}

        def slot_of(v: SSAValue) -> int:
            if v not in slot:
                slot[v] = len(slot)
            return slot[v]

        for a in block.args:
            slot_of(a)
        self.n_inputs = attr_int(module, "blutrain.inputs")
        self.n_args = len(block.args)
        self.launches: list[Launch] = []
        self.by_uid: dict[int, Launch] = {}
        self.member_of: dict[int, int] = {}  # uid of a fused region's member → its index there
        registry = kernels()
        target = codegen_cuda.TARGET if device == "cuda" else codegen_numpy.TARGET
        self.outputs: list[int] = []
        for o in block.ops:
            reads = [slot_of(v) for v in o.operands]
            results = [slot_of(r) for r in o.results]
            uid_attr = o.properties.get("uid")
            uid = int(uid_attr.data) if isinstance(uid_attr, IntAttr) else -1
            if isinstance(o, func.ReturnOp):
                self.outputs = reads
                continue
            if is_kernel(o):
                fn = registry.lookup(kernel_name(o), o.properties["device"].data,
                                     as_dtype(o.properties["dtype"].data)).fn
                launch = Launch("kernel", fn, reads, results, decode(o.properties["args"]),
                                decode(o.properties["ret"]), uid)
                self.by_uid[uid] = launch
            elif isinstance(o, ViewOp):
                shape = type_info(o.results[0].type)[0]
                offset = int(o.properties["offset"].data)  # type: ignore[attr-defined]
                strides = tuple(decode(o.properties["strides"]))

                def view(root: Any, _o: int = offset, _sh: tuple[int, ...] = shape,
                         _st: tuple[int, ...] = strides) -> Any:
                    return strided_view(root, _o, _sh, _st)

                launch = Launch("view", view, reads, results, uid=uid)
            elif isinstance(o, AssignOp):
                launch = Launch("assign", _assign, reads, [], decode(o.properties["args"]), uid=uid)
            elif isinstance(o, CollectiveOp):
                call = (collectives or {}).get(uid)
                if call is None:
                    raise CompilerError(f"the executor has no call for collective {o.what.data!r} (traced op "
                                        f"{uid}); build the Program with the trace's collectives")
                launch = Launch("collective", call, reads, [], uid=uid)
            elif isinstance(o, FusedOp):
                templates = codegen_numpy.member_templates(o)
                launch = Launch("fused", target.compile_region(o), reads, results, templates,
                                codegen_numpy.region_consts(templates))
                members = [m for m in o.body.block.ops if "uid" in m.properties]
                for k, m in enumerate(members):
                    self.by_uid[int(m.properties["uid"].data)] = launch
                    self.member_of[int(m.properties["uid"].data)] = k
            else:
                raise CompilerError(f"the executor cannot run {o.name}")
            self.launches.append(launch)
        self.n_slots = len(slot)
        self.final_joins = self._place_joins()
        # drop each intermediate right after its last reader (never arguments or outputs)
        last: dict[int, int] = {}
        for i, launch in enumerate(self.launches):
            for s in (*launch.reads, *launch.results):
                last[s] = i
        keep = set(range(self.n_args)) | set(self.outputs)
        for s, i in last.items():
            if s not in keep:
                self.launches[i].frees.append(s)
        self.slots: list[Any] = [None] * self.n_slots

    def _place_joins(self) -> list[int]:
        """Give each collective to the first later launch that touches a buffer it reads or writes (a view
        launch only names memory; the launches that use the view touch it); the collectives nothing later
        touches are joined at the end, returned. Collectives stay in order among themselves: a runner issues
        them in program order on one communication stream."""
        buffer = list(range(self.n_slots))  # slot → the slot of the buffer it lives in
        for launch in self.launches:
            if launch.kind == "view":
                buffer[launch.results[0]] = buffer[launch.reads[0]]
        open_: dict[int, set[int]] = {}  # collective's launch index → the buffers it holds
        for i, launch in enumerate(self.launches):
            if launch.kind == "view":
                continue
            touched = {buffer[s] for s in (*launch.reads, *launch.results)}
            if launch.kind != "collective":
                for c in [c for c, held in open_.items() if held & touched]:
                    launch.joins.append(c)
                    del open_[c]
            else:
                open_[i] = touched
        return sorted(open_)

    @property
    def collective_count(self) -> int:
        return sum(1 for launch in self.launches if launch.kind == "collective")

    def update(self, uid: int, template: tuple[Any, ...]) -> bool:
        """Give the launch of traced call ``uid`` new scalar arguments; False if no launch has them."""
        launch = self.by_uid.get(uid)
        if launch is None:
            return False
        if launch.kind == "fused":
            launch.template[self.member_of[uid]] = template
            launch.ret = codegen_numpy.region_consts(launch.template)
        else:
            # ``template`` is the traced call's; a pass that handed the kernel a trailing operand (the
            # adamw-grad-scale pass's clip coefficient) made the launch's longer: keep that tail
            launch.template = (*template, *launch.template[len(template):])
        return True

    def drop_results(self) -> None:
        """Forget what the last run left in the slots (its outputs); the arguments stay."""
        self.slots[self.n_args:] = [None] * (self.n_slots - self.n_args)

    def run(self) -> None:
        slots = self.slots
        runner = self.runner
        for i, launch in enumerate(self.launches):
            for c in launch.joins:
                runner.join(c)
            values = [slots[s] for s in launch.reads]
            kind = launch.kind
            if kind == "kernel":
                out = launch.fn(*_substitute(launch.template, values))
                if launch.results:
                    dest: list[Any] = [None] * len(launch.results)
                    _flat_results(launch.ret, out, dest)
                    for s, v in zip(launch.results, dest, strict=True):
                        slots[s] = v
            elif kind == "view":
                slots[launch.results[0]] = launch.fn(values[0])
            elif kind == "assign":
                launch.fn(launch.template, values)
            elif kind == "collective":
                runner.issue(i, launch.fn, values)
            else:  # fused: ``ret`` holds the region's scalar arguments
                for s, v in zip(launch.results, launch.fn(launch.ret, *values), strict=True):
                    slots[s] = v
            for s in launch.frees:
                slots[s] = None
        for c in self.final_joins:
            runner.join(c)


def _assign(template: tuple[Any, ...], values: list[Any]) -> None:
    target, key, value = _substitute(template, values)
    target[key] = value



class CPUExecutor:
    """Runs a :class:`Program` on the CPU: copy the inputs in, run the list."""

    report: ArenaReport | None = None  # the CPU executor plans no arena

    def __init__(self, program: Program, inputs: list[Any], state: list[Any]) -> None:
        self.program = program
        # static input buffers, in the memory layout of the traced ones (order "K"): a buffer that crosses a cut
        # of a split step may be a kernel's dense but permuted result, and its views address its memory
        self.inputs = [a.copy(order="K") for a in inputs]
        program.slots[:len(inputs)] = self.inputs
        program.slots[len(inputs):program.n_args] = state
        self.updates = 0  # calls whose scalar kernel arguments changed
        self.closed = False

    def run(self, inputs: list[Any]) -> list[Any]:
        if self.closed:
            raise CompilerError("this compiled graph was closed (its compiled function was reset); call the "
                                "compiled function again to trace anew")
        for buf, new in zip(self.inputs, inputs, strict=True):
            buf[...] = new
        self.program.run()
        slots = self.program.slots
        return [slots[s].copy(order="K") for s in self.program.outputs]  # the layout the kernels made

    def updated(self) -> None:
        """Scalars changed: the launches already hold the new ones, nothing to redo on the CPU."""
        self.updates += 1

    def close(self) -> None:
        """Drop the static inputs and every slot; the executor cannot run after."""
        self.closed = True
        self.program.slots[:] = [None] * len(self.program.slots)
        self.inputs = []


class CupyMemory:
    """The device under an allocation run (``arena.DeviceMemory``): fresh blocks from a private CuPy pool,
    and the pointers handed to CuPy as ``UnownedMemory`` that keeps the request's owner alive."""

    def __init__(self, cupy: Any, pool: Any) -> None:
        self.pool = pool
        self._unowned = cupy.cuda.memory.UnownedMemory
        self._pointer = cupy.cuda.MemoryPointer
        self._device = int(cupy.cuda.Device().id)  # given, so that no pointer query runs during capture

    def block(self, nbytes: int) -> tuple[int, object]:
        p = self.pool.malloc(nbytes)
        # the pool too: its blocks are freed with it, even those still handed out
        return int(p.ptr), (p, self.pool)

    def pointer(self, address: int, nbytes: int, owner: object) -> object:
        return self._pointer(self._unowned(address, nbytes, owner, self._device), 0)


def _release_cached() -> None:
    """The cuda backend's ``empty_cache`` (where it has one): the traced call's values went back to the
    process allocator's cache, and the recording run's pool and the arena should take that memory, not
    come on top of it (the reserved peak was the traced call's plus the arena's)."""
    from blutrain.tensor.backend import get_backend

    release = getattr(get_backend("cuda"), "empty_cache", None)
    if release is not None:
        release()


class CUDAGraphExecutor:
    """Runs a :class:`Program` as one CUDA graph (CuPy stream capture) inside one planned arena."""

    def __init__(self, program: Program, inputs: list[Any], state: list[Any], defer_capture: bool = False) -> None:
        """``defer_capture``: capture at the first :meth:`run` instead of now (the compiler's choice: by then
        the trace has dropped its arrays, so that the recording run, its pool and the arena never sit beside
        the traced call's values)."""
        import cupy

        self.cupy = cupy
        self.program = program
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # the recording run's requests, those the arena does not serve and a run without a graph come from here
        self.pool = cupy.cuda.MemoryPool()
        self.memory = CupyMemory(cupy, self.pool)
        program.runner = StreamCollectives(cupy, self.pool)
        # the static input buffers come from the process's allocator, like the arena: its statistics see them
        self.inputs = [cupy.array(a, copy=True) for a in inputs]  # order "K" (CuPy's default): the traced layout
        program.slots[:len(inputs)] = self.inputs
        program.slots[len(inputs):program.n_args] = state
        self.graph: Any = None
        self.captures = 0
        self.updates = 0  # calls whose scalar kernel arguments changed (each one captures again)
        self.eager = False  # set when capture fails: the list then runs launch by launch
        self.capture_error: str | None = None  # why, with the frames that led there
        self.placement: Placement | None = None
        self.arena: Any = None  # the arena's MemoryPointer, from the process's allocator
        self.recorded_pool_bytes = 0  # CuPy's pool after the recording run: the executor without a plan
        self.report: ArenaReport | None = None
        self.first_fallback: str | None = None  # the first request of the kept capture the arena did not serve
        self.closed = False
        if not defer_capture:
            self._capture()

    def _capture(self) -> None:
        cupy = self.cupy
        cupy.cuda.get_current_stream().synchronize()
        if self.eager:
            return
        if self.placement is None:
            _release_cached()
            recording = RecordingRun(self.memory)
            if self._capture_run(recording) is None:
                return
            self.program.drop_results()  # the recording's outputs go back to the pool before it is emptied
            self.recorded_pool_bytes = int(self.pool.total_bytes())
            self._plan(recording)
        for attempt in (1, 2):
            assert self.placement is not None
            serving = ServingRun(self.memory, self.placement, int(self.arena.ptr), self.arena)
            graph = self._capture_run(serving)
            if graph is None:
                return
            if not serving.fallbacks:
                break
            log.debug("blutrain.compiler: %d of %d allocation requests of the captured step did not match the "
                      "recorded run and came from the pool (first: %s)%s", serving.fallbacks,
                      len(serving.sizes), serving.first_fallback,
                      "; planning again from this run" if attempt == 1 else "")
            if attempt == 1:  # e.g. a kernel that allocated a cache in the recording run holds it since
                graph = None
                self.program.drop_results()
                self._plan(serving)
        self.graph = graph
        self.captures += 1
        self.first_fallback = serving.first_fallback
        assert self.placement is not None
        self.report = ArenaReport(arena_bytes=self.placement.nbytes, request_bytes=self.placement.requested,
                                  live_peak_bytes=self.placement.live_peak, pool_bytes=self.recorded_pool_bytes,
                                  requests=len(serving.sizes), fallbacks=serving.fallbacks)
        log.debug("blutrain.compiler: captured step in an arena of %d bytes (%d requests of %d bytes in all, "
                  "at most %d live at once; the recording run's pool held %d; %d from the pool)",
                  self.report.arena_bytes, self.report.requests, self.report.request_bytes,
                  self.report.live_peak_bytes, self.report.pool_bytes, self.report.fallbacks)

    def _plan(self, run: AllocationRun) -> None:
        """Place the requests of ``run`` and allocate the arena (the previous one, and the pool's free blocks,
        go back first)."""
        self.arena = None
        self.pool.free_all_blocks()
        _release_cached()
        self.placement = place(run.requests())
        arena = self.cupy.cuda.alloc(self.placement.nbytes + ALIGN)
        # offsets are multiples of ALIGN from a base aligned to it (allocators align to 512, this makes sure)
        self.arena = arena + (-int(arena.ptr)) % ALIGN

    def _capture_run(self, run: AllocationRun) -> Any:
        """One capture of the launch list with ``run`` as the allocator: the graph, or None if capture failed
        (the executor then runs the list without a graph, from its pool)."""
        cupy = self.cupy
        self.program.drop_results()  # the last capture's outputs: not needed, and they hold memory
        collecting = gc.isenabled()
        gc.disable()  # frees come from reference counts alone, at the same points in every run
        failure: Exception | None = None
        try:
            with cupy.cuda.using_allocator(run), self.stream:
                self.stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    self.program.run()
                except Exception as exc:  # e.g. a library call that stream capture forbids
                    failure = exc
                    self.program.runner.join_all()  # a capture ends only with every forked stream joined
                finally:
                    graph = self.stream.end_capture()
                    run.finish()
        finally:
            if collecting:
                gc.enable()
        if failure is None:
            return graph
        # Run the launch list on the stream without a graph: correct, but every launch costs host time.
        log.warning("blutrain.compiler: CUDA graph capture failed (%s); running the compiled launch list "
                    "without a graph", failure)
        self.eager = True
        self.capture_error = "".join(traceback.format_exception(failure)[-16:])
        self.graph = None
        self.program.drop_results()
        self.placement = self.arena = self.report = None
        return None

    def updated(self) -> None:
        """Scalar arguments changed: they are baked into the graph's kernel parameters, so recapture (in the
        same arena: the requests are those of the recorded run)."""
        self.updates += 1
        self.graph = None

    def run(self, inputs: list[Any]) -> list[Any]:
        cupy = self.cupy
        if self.closed:
            raise CompilerError("this compiled graph was closed (its compiled function was reset); call the "
                                "compiled function again to trace anew")
        if self.graph is None:
            self._capture()
        # Inputs, state and the step scalars the host refilled were written on the caller's stream: the step
        # waits for them there, and the caller's stream waits for the step's results below. No host wait:
        # the next call's host work overlaps this step on the GPU.
        caller = cupy.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            for buf, new in zip(self.inputs, inputs, strict=True):
                buf[...] = new
            if self.eager:
                self.program.run()
            else:
                self.graph.launch(self.stream)
        with self.stream:
            # The results come from the process's allocator, not the arena: the next replay writes the arena
            # over a result held since.
            slots = self.program.slots
            outs = [slots[s].copy(order="K") for s in self.program.outputs]  # the layout the kernels made
        caller.wait_event(self.stream.record())
        return outs

    def close(self) -> None:
        """Give the graph, the arena, the static inputs and the pool's blocks back now; the executor cannot
        run after. (Dropping the executor frees the same; this does it at once, e.g. between benchmark
        configurations that share the GPU.)"""
        if self.closed:
            return
        self.stream.synchronize()
        self.closed = True
        self.graph = None
        self.program.slots[:] = [None] * len(self.program.slots)
        self.inputs = []
        self.arena = self.placement = None
        self.stream = None  # memory kept per stream (a kernel library's scratch) goes with it
        self.pool.free_all_blocks()

    @property
    def pool_bytes(self) -> int:
        """Bytes CuPy's private pool holds now (requests the arena did not serve; a run without a graph)."""
        return int(self.pool.total_bytes())

    @property
    def arena_bytes(self) -> int:
        """Bytes of the planned arena (0 without a graph)."""
        return 0 if self.placement is None else self.placement.nbytes


__all__ = ["CPUExecutor", "CUDAGraphExecutor", "CollectiveRunner", "CupyMemory", "InlineCollectives", "Launch",
           "Program", "StreamCollectives", "strided_view"]
