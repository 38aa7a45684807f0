"""The executor: a compiled module as a flat list of launches on static buffers.

:class:`Program` turns the step function's ops, in order, into launches — a registered kernel (the
one kernel selection picked), a strided view, an in-place assignment, or a generated fused kernel —
each reading and writing slots. Inputs are copied into static buffers owned by the program; state
(parameters, optimizer state) is the model's own arrays, updated in place. A slot is dropped right
after its last reader, so memory follows the liveness the planner computed.

On the CPU, :class:`CPUExecutor` runs the list. On CUDA, :class:`CUDAGraphExecutor` captures one run
of the list into a CUDA graph on its own stream and memory pool (every buffer the graph uses stays in
that pool, so nothing else can take it); each call copies the inputs into their static buffers and
launches the graph once.

A kernel's Python scalar arguments are baked into the captured graph, so a call whose scalars changed
(``updated()``, counted in ``updates``) captures it again. Numbers meant to change every step (an
optimizer's lr and bias corrections) therefore live in device arrays that are graph state
(``blutrain.optim.StepScalars``): the host refills them before the launch, and one capture serves
every step.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from xdsl.dialects import func
from xdsl.dialects.builtin import IntAttr, ModuleOp
from xdsl.ir import SSAValue

from blutrain.compiler import codegen_cuda, codegen_numpy
from blutrain.compiler.dialect import AssignOp, FusedOp, Operand, ViewOp, decode, is_kernel, kernel_name, type_info
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


class Launch:
    """One entry of the program: ``fn`` applied to the slots ``reads``, results into ``results``."""

    __slots__ = ("fn", "frees", "kind", "reads", "results", "ret", "template", "uid")

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


class Program:
    """The launches of one compiled module, with its slots (one per SSA value)."""

    def __init__(self, module: ModuleOp, device: str) -> None:
        self.device = device
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

    def update(self, uid: int, template: tuple[Any, ...]) -> bool:
        """Give the launch of traced call ``uid`` new scalar arguments; False if no launch has them."""
        launch = self.by_uid.get(uid)
        if launch is None:
            return False
        if launch.kind == "fused":
            launch.template[self.member_of[uid]] = template
            launch.ret = codegen_numpy.region_consts(launch.template)
        else:
            launch.template = template
        return True

    def run(self) -> None:
        slots = self.slots
        for launch in self.launches:
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
            else:  # fused: ``ret`` holds the region's scalar arguments
                for s, v in zip(launch.results, launch.fn(launch.ret, *values), strict=True):
                    slots[s] = v
            for s in launch.frees:
                slots[s] = None


def _assign(template: tuple[Any, ...], values: list[Any]) -> None:
    target, key, value = _substitute(template, values)
    target[key] = value


class CPUExecutor:
    """Runs a :class:`Program` on the CPU: copy the inputs in, run the list."""

    def __init__(self, program: Program, inputs: list[Any], state: list[Any]) -> None:
        self.program = program
        self.inputs = [a.copy() for a in inputs]  # static input buffers
        program.slots[:len(inputs)] = self.inputs
        program.slots[len(inputs):program.n_args] = state
        self.updates = 0  # calls whose scalar kernel arguments changed

    def run(self, inputs: list[Any]) -> list[Any]:
        for buf, new in zip(self.inputs, inputs, strict=True):
            buf[...] = new
        self.program.run()
        slots = self.program.slots
        return [slots[s].copy() for s in self.program.outputs]

    def updated(self) -> None:
        """Scalars changed: the launches already hold the new ones, nothing to redo on the CPU."""
        self.updates += 1


class CUDAGraphExecutor:
    """Runs a :class:`Program` as one CUDA graph (CuPy stream capture)."""

    def __init__(self, program: Program, inputs: list[Any], state: list[Any]) -> None:
        import cupy

        self.cupy = cupy
        self.program = program
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(self.pool.malloc):
            self.inputs = [cupy.array(a, copy=True) for a in inputs]
        program.slots[:len(inputs)] = self.inputs
        program.slots[len(inputs):program.n_args] = state
        self.graph: Any = None
        self.captures = 0
        self.updates = 0  # calls whose scalar kernel arguments changed (each one captures again)
        self.eager = False  # set when capture fails: the list then runs launch by launch
        self.capture_error: str | None = None  # why, with the frames that led there
        self._capture()

    def _capture(self) -> None:
        cupy = self.cupy
        cupy.cuda.get_current_stream().synchronize()
        if self.eager:
            return
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
            failure: Exception | None = None
            try:
                self.program.run()
            except Exception as exc:  # e.g. CuPy refuses cuBLAS calls during stream capture
                failure = exc
            finally:
                graph = self.stream.end_capture()
        if failure is not None:
            # Run the launch list on the stream without a graph: correct, but every launch costs host time.
            log.warning("blutrain.compiler: CUDA graph capture failed (%s); running the compiled launch list "
                        "without a graph", failure)
            self.eager = True
            self.capture_error = "".join(traceback.format_exception(failure)[-16:])
            self.graph = None
            return
        self.graph = graph
        self.captures += 1

    def updated(self) -> None:
        """Scalar arguments changed: they are baked into the graph's kernel parameters, so recapture."""
        self.updates += 1
        self.graph = None

    def run(self, inputs: list[Any]) -> list[Any]:
        cupy = self.cupy
        if self.graph is None:
            self._capture()
        # inputs, state and the step scalars the host refilled were written on the caller's stream
        cupy.cuda.get_current_stream().synchronize()
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            for buf, new in zip(self.inputs, inputs, strict=True):
                buf[...] = new
            if self.eager:
                self.program.run()
            else:
                self.graph.launch(self.stream)
        with self.stream:
            # The results come from the process's allocator, not the graph's pool: a free block of that pool
            # may be scratch of the graph, which the next replay would write over a result held since.
            slots = self.program.slots
            outs = [slots[s].copy() for s in self.program.outputs]
        self.stream.synchronize()
        return outs

    @property
    def pool_bytes(self) -> int:
        return int(self.pool.total_bytes())


__all__ = ["CPUExecutor", "CUDAGraphExecutor", "Launch", "Program", "strided_view"]
