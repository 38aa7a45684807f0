"""The executor: a compiled module as a flat list of launches on static buffers.

:class:`Program` turns the step function's ops, in order, into launches — a registered kernel (the
one kernel selection picked), a strided view, an in-place assignment, a collective, or a generated fused
kernel (the device's compile target compiles it: :mod:`blutrain.compiler.target`) — each reading and writing
slots. Inputs are copied into static buffers owned by the program; state (parameters, optimizer state) is the
model's own arrays, updated in place. A slot is dropped right after its last reader, so memory follows the
liveness the planner computed.

A device's compile target runs the program: on the CPU :class:`CPUExecutor` runs the list; on CUDA the CuPy
backend plugin's executor captures one run of it into a CUDA graph inside one planned arena (``arena.py``).

A collective of the step (``blutrain.collective``: a bucket's all-reduce, a reduce-scatter, a parameter
all-gather) is a launch like the others. The program knows, for each one, the first later launch that touches
one of its operands' buffers (reads or writes them): that launch *joins* it, and the launches between run beside
it. The executor's :class:`CollectiveRunner` decides what that means: on the CPU a collective completes where it
is issued (:class:`InlineCollectives`); on CUDA it is forked onto a communication stream ordered after
everything before it, and the launch that joins it waits for it there, so that a bucket's reduction runs under
the rest of backward, inside the one captured graph. A runner holds the collective's operand arrays until the
join, so an arena planner sees their buffers live until then and places nothing over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from xdsl.dialects import func
from xdsl.dialects.builtin import IntAttr, ModuleOp
from xdsl.ir import SSAValue

from blutrain.compiler import codegen_numpy
from blutrain.compiler.arena import ArenaReport
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
from blutrain.compiler.target import compile_target
from blutrain.tensor.backend import ARRAY_MODULES
from blutrain.tensor.dtype import as_dtype
from blutrain.tensor.kernel import kernels


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
        # traced call → its launches: more than one where a pass made an op again (rematerialize), each of which
        # takes a probe's new scalars
        self.by_uid: dict[int, list[Launch]] = {}
        self.member_of: dict[int, int] = {}  # uid of a fused region's member → its index there
        registry = kernels()
        target = compile_target(device)
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
                if uid >= 0:  # an op a pass made (no traced call) takes no probe's scalars
                    self.by_uid.setdefault(uid, []).append(launch)
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
                    self.by_uid.setdefault(int(m.properties["uid"].data), []).append(launch)
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
        """Give the launches of traced call ``uid`` new scalar arguments; False if no launch has them."""
        launches = self.by_uid.get(uid, [])
        for launch in launches:
            if launch.kind == "fused":
                launch.template[self.member_of[uid]] = template
                launch.ret = codegen_numpy.region_consts(launch.template)
            else:
                # ``template`` is the traced call's; a pass that handed the kernel a trailing operand (the
                # adamw-grad-scale pass's clip coefficient) made the launch's longer: keep that tail
                launch.template = (*template, *launch.template[len(template):])
        return bool(launches)

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


__all__ = ["CPUExecutor", "CollectiveRunner", "InlineCollectives", "Launch", "Program", "strided_view"]
