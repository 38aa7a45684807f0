"""The "cuda" compile target: how a step compiled by blutrain.compiler runs on CUDA (the compiler's
:class:`~blutrain.compiler.target.CompileTarget`, registered through ``blutrain_register_compile_targets``).

A fused elementwise region becomes one CuPy ``ElementwiseKernel`` from the compiler's CUDA C
(:func:`blutrain.compiler.codegen_cuda.kernel_spec`), compiled once per distinct region. The program runs in
:class:`CUDAGraphExecutor`: one run of its launch list captured into a CUDA graph on the executor's own stream,
inside one planned arena (``blutrain.compiler.arena``): a first capture records every allocation request the
kernels make and when each is freed, the requests are placed by liveness, and the capture that is kept takes
each one at its offset in an arena of the planned size (the graph's buffers stay there, so nothing else can
take them). Each call copies the inputs into their static buffers and launches the graph once. A kernel's
Python scalar arguments are baked into the captured graph, so a call whose scalars changed (``updated()``,
counted in ``updates``) captures it again; numbers meant to change every step (an optimizer's lr and bias
corrections) live in device arrays that are graph state (``blutrain.optim.StepScalars``), and one capture
serves every step.

The step's collectives run through :class:`StreamCollectives`: each is a branch of the graph on a side stream,
ordered after everything before it and joined by the first launch that touches its buffers.

This module imports blutrain.compiler, which this plugin does not need otherwise: the plugin imports it only
when the compiler asks for the target.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.compiler import codegen_cuda
from blutrain.compiler.arena import ALIGN, AllocationRun, ArenaReport, Placement, RecordingRun, ServingRun, place
from blutrain.compiler.dialect import FusedOp
from blutrain.compiler.errors import CompilerError
from blutrain.compiler.executor import Program
from blutrain.tensor.dtype import HALF_NAMES
from blutrain_backend_cupy.backend import backend

log = logging.getLogger("blutrain.compiler")


_kernels: dict[str, Any] = {}  # kernel name (the region's IR hash) → its compiled ElementwiseKernel


def compile_region(op: FusedOp) -> Callable[..., Any]:
    """The region as ``fn(consts, *inputs) -> tuple`` on CuPy arrays (compiled once per distinct region)."""
    import cupy

    spec = codegen_cuda.kernel_spec(op)
    kernel = _kernels.get(spec.name)
    if kernel is None:
        kernel = _kernels[spec.name] = cupy.ElementwiseKernel(spec.in_params, spec.out_params, spec.operation,
                                                              spec.name, preamble=codegen_cuda.PREAMBLE)
    u16 = cupy.uint16

    def fn(consts: list[Any], *inputs: Any) -> Any:
        paths = [np.int32(codegen_cuda.pow_fast_path(consts[k])) for k in spec.exponents]  # this call's exponents
        args = [x.view(u16) if h else x for x, h in zip(inputs, spec.half_inputs, strict=True)]
        results = [cupy.empty(shape, dtype=u16 if dt.name in HALF_NAMES else dt.np) for shape, dt in spec.results]
        kernel(*consts, *paths, *args, *results)
        return tuple(r.view(dt.np) if dt.name in HALF_NAMES else r
                     for r, (_, dt) in zip(results, spec.results, strict=True))

    return fn


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
        try:
            for key in list(self.pending):
                self.join(key)
        finally:
            self.pending.clear()  # after a failed capture too: no stale collective is held or joined later


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
    """The cuda backend's cached blocks go back to the device: the traced call's values went back to the
    process allocator's cache, and the recording run's pool and the arena should take that memory, not
    come on top of it (the reserved peak was the traced call's plus the arena's)."""
    backend().empty_cache()


class CUDAGraphExecutor:
    """Runs a compiled :class:`~blutrain.compiler.executor.Program` as one CUDA graph (CuPy stream capture)
    inside one planned arena (the compiler's :class:`~blutrain.compiler.target.Executor`)."""

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
                    with contextlib.suppress(Exception):  # the capture may be broken already: end_capture says so
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


class CudaTarget:
    """The "cuda" compile target: fused regions as CUDA elementwise kernels, programs as one CUDA graph."""

    device = "cuda"

    def compile_region(self, op: FusedOp) -> Callable[..., Any]:
        return compile_region(op)

    def executor(self, program: Program, inputs: list[Any], state: list[Any]) -> CUDAGraphExecutor:
        # captured at the first run, not now: by then the trace has dropped its arrays, so that the recording
        # run, its pool and the arena never sit beside the traced call's values
        return CUDAGraphExecutor(program, inputs, state, defer_capture=True)


TARGET = CudaTarget()

__all__ = ["TARGET", "CUDAGraphExecutor", "CudaTarget", "CupyMemory", "StreamCollectives", "compile_region"]
