"""Tracing: run a function once for real while recording every kernel it dispatches.

Every op of ``blutrain.tensor`` ends in one call of a kernel found in the flat table
:data:`blutrain.tensor.dispatch.TABLE` — forward ops, autograd's derivative rules and the optimizers'
multi-tensor kernels alike. While a :class:`Tracer` is active, dispatch's interceptor puts a recording
wrapper around every kernel it looks up, so nothing is missed and no op module is patched. Arrays computed during
the trace are :class:`TraceArray` proxies around the real result (the trace executes the step, so
its first call returns real values); operations that ops perform on arrays outside kernels (views,
``astype``, ``a[key] = v``) go through the proxy and are recorded too. A proxy refuses to be read
on the host: ``.item()``, ``bool(t)``, ``float(t)`` raise :class:`DataDependentError` naming the
line of the traced function. Arrays that existed before the trace (parameters, optimizer state,
buffers) reach kernels as plain backend arrays; they become the graph's *state*, identified by the
array that owns their memory (views of them are recorded as ``view`` events).

The same machinery re-runs the function in *probe* mode on later calls that a graph replay cannot serve
(new float arguments, a changed optimizer guard; every call under ``replay="probe"``): kernels do not run, each
intercepted call is matched against the recorded event of the same position (same op, same
operands) and answers with the recorded proxies. By then the traced call's arrays are gone
(:meth:`Tracer.release`, once the graph is built): a proxy is its :class:`Value`'s description only, views
are computed on a NumPy array of that shape and strides over no memory, and host-side argument checks
read the call's own inputs (or, for a computed value, the result the traced call's check got).
Python's own side effects (the optimizer's step count, a learning-rate schedule) happen as in eager
mode, and scalar kernel arguments that changed are reported so that the executor can update them (on
CUDA that is a new capture). A call that takes another path raises :class:`GraphBreakError`.

Host code may also write a state array outside kernels: the optimizers refill their per-step
scalars (``blutrain.optim.StepScalars``: lr, bias corrections) on every call, in probe mode too, and
the compiled program reads them from the array when it runs, so nothing changes in the graph. That
holds only while each such write comes before the first kernel of the call that reads the array:
a trace that sees a small state array change between two kernels that read it, with no kernel
writing it, raises :class:`TracingError` (a replay would give both kernels the last values).

Collectives are not kernels. While a tracer is active it is also this thread's
:mod:`blutrain.tensor.capture`: a collective of a group declared with ``blutrain.dist.traceable``
hands itself to :meth:`Tracer.host_call`, which runs it with tracing paused and records it as a
``collective`` event (its operands, and a call that issues it again on real arrays); a later call
checks it like a kernel and does not run it, and the compiled program issues it at its place among the
kernels (a ``blutrain.collective`` op: :mod:`blutrain.compiler.executor`). A collective of any other group reaches
:meth:`Tracer.refuse` and raises :class:`TracingError` naming the line that called it.
"""

from __future__ import annotations

import gc
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from blutrain.compiler.dialect import Operand, scalars_equal
from blutrain.compiler.errors import DataDependentError, GraphBreakError, TracingError
from blutrain.tensor import capture, dispatch
from blutrain.tensor.backend import ARRAY_DEVICES, ARRAY_MODULES
from blutrain.tensor.dtype import DType, from_numpy_dtype
from blutrain.tensor.kernel import Kernel
from blutrain.tensor.tensor import Tensor


class _Local(threading.local):
    tracer: Tracer | None = None


_local = _Local()


def active() -> Tracer | None:
    """The tracer of this thread, or None."""
    return _local.tracer


# -- values and events ---------------------------------------------------------------------------
@dataclass
class Value:
    """One array of the trace: a buffer (``root == vid``) or a strided view of one."""

    vid: int
    shape: tuple[int, ...]
    dtype: DType
    root: int
    offset: int = 0  # elements from the root's first element
    strides: tuple[int, ...] = ()  # elements


@dataclass
class Event:
    """One recorded call: a kernel, a view or an in-place assignment.

    ``template`` is the call's positional arguments with :class:`Operand` markers for arrays;
    ``ret`` is the return value with ``Operand(i)`` for ``results[i]``.
    """

    uid: int
    kind: str  # "kernel" | "view" | "assign" | "collective"
    op: str
    device: str
    dtype: str
    template: tuple[Any, ...]
    operands: list[int]
    results: list[int]
    ret: Any = None
    writes: tuple[int, ...] = ()
    # a collective: what issues it again on the real arrays of its operands, the function it called, and
    # (operand index, count) of the version bumps it made (a later call makes them without running it)
    call: Callable[[list[Any]], None] | None = None
    fn: Any = None
    bumps: tuple[tuple[int, int], ...] = ()


def _ptr(a: Any) -> int:
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)  # CuPy
    if isinstance(ptr, int):
        return ptr
    return int(a.__array_interface__["data"][0])


def _owner(a: Any) -> Any:
    """The array that owns ``a``'s memory (the end of its ``base`` chain)."""
    array_type = type(a)
    owner = a
    while True:  # as_strided/broadcast_to views have a non-array base (NumPy's DummyArray) in the chain
        a = getattr(a, "base", None)
        if a is None:
            return owner
        if isinstance(a, array_type):
            owner = a


def _memory(a: Any) -> Any:
    """The allocation ``a`` lives in: CuPy's memory object (its views need not keep a ``base``), or
    NumPy's owning array."""
    if isinstance(a, np.ndarray):
        return _owner(a)
    data = getattr(a, "data", None)
    mem = getattr(data, "mem", None)
    return mem if mem is not None else _owner(a)


def _root_array(a: Any) -> Any:
    """An array over the whole allocation of ``a``: its owner (NumPy), or a flat array over the
    CuPy memory block, so that every view of it has a non-negative offset."""
    if isinstance(a, np.ndarray):
        return _owner(a)
    data = getattr(a, "data", None)
    mem = getattr(data, "mem", None)
    if mem is None:
        return _owner(a)
    owner = _owner(a)
    if owner.data.ptr == mem.ptr and owner.nbytes == mem.size and owner.flags.c_contiguous:
        return owner
    xp = ARRAY_MODULES[type(a)]
    return xp.ndarray((mem.size // a.dtype.itemsize,), a.dtype, memptr=xp.cuda.MemoryPointer(mem, 0))


def _is_array(x: Any) -> bool:
    return type(x) in ARRAY_MODULES and type(x) is not TraceArray


def _device_of(a: Any) -> str:
    """The device type of the backend whose array ``a`` is (a NumPy subclass is the CPU's)."""
    found = ARRAY_DEVICES.get(type(a))
    if found is not None:
        return found
    return "cpu" if isinstance(a, np.ndarray) else f"<no backend's array: {type(a).__name__}>"


def user_frame() -> str:
    """``file:line: code`` of the innermost frame outside blutrain's tensor/autograd/compiler/kernels/optim/dist,
    the optimizer, cupy and comm plugins, NumPy and CuPy: the line of the traced function that did what
    the error is about."""
    skip = ("blutrain/tensor/", "blutrain/autograd/", "blutrain/compiler/", "blutrain/kernels/", "blutrain/optim/",
            "blutrain/dist/", "blutrain_optim_", "blutrain_backend_cupy", "blutrain_comm_", "/numpy/", "/cupy/",
            "/cupyx/")
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if not any(s in name for s in skip):
            return f"{Path(frame.filename)}:{frame.lineno}: {frame.line or ''}".rstrip()
    return "<unknown>"


# -- the proxy -----------------------------------------------------------------------------------
class TraceArray:
    """A traced array: its value in the graph, and while its trace runs the real array computed then.

    After the trace (:meth:`Tracer.release`) and in probe mode a proxy holds no data: its shape, dtype
    and strides come from its :class:`Value`, views are computed from that description, and host-side
    argument checks read ``host`` (the call's own input array or a view of it) where there is one.
    """

    __slots__ = ("__weakref__", "concrete", "host", "value", "vid")

    def __init__(self, value: Value, concrete: Any = None, host: Any = None) -> None:
        self.value = value
        self.vid = value.vid
        self.concrete = concrete
        self.host = host

    # metadata: from the real array while there is one, else from the value's description
    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.value.shape, dtype=np.int64))

    @property
    def dtype(self) -> Any:
        return self.value.dtype.np if self.concrete is None else self.concrete.dtype

    @property
    def strides(self) -> tuple[int, ...]:
        if self.concrete is not None:
            return self.concrete.strides  # type: ignore[no-any-return]
        return tuple(s * self.value.dtype.itemsize for s in self.value.strides)

    @property
    def itemsize(self) -> int:
        return self.value.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def flags(self) -> Any:
        return _shell(self.value).flags if self.concrete is None else self.concrete.flags

    @property
    def base(self) -> None:
        return None

    def __len__(self) -> int:
        if not self.value.shape:
            raise TypeError("len() of a 0-d traced array")
        return self.value.shape[0]

    def __repr__(self) -> str:
        return f"TraceArray(%{self.vid}, shape={self.shape}, dtype={self.dtype})"

    # recorded operations
    def astype(self, dtype: Any, copy: bool = True) -> TraceArray:
        return _tracer("astype").cast(self, dtype)

    def copy(self) -> TraceArray:
        return _tracer("copy").copy(self)

    def reshape(self, *shape: Any, order: str = "C") -> TraceArray:
        return _tracer("reshape").view(self, lambda c: _reshape(c, shape))

    def transpose(self, *axes: Any) -> TraceArray:
        return _tracer("transpose").view(self, lambda c: c.transpose(*axes))

    @property
    def T(self) -> TraceArray:
        return self.transpose()

    def __getitem__(self, key: Any) -> Any:
        if any(_is_array(k) for k in (key if isinstance(key, tuple) else (key,))):
            # a host-side check masking with its own (untraced) result
            return self._host_check("indexing with an array", None, lambda a: a[key])
        _basic_key(key, "indexing a traced array")
        view_key = (*key, Ellipsis) if isinstance(key, tuple) else (key, Ellipsis)
        if any(k is Ellipsis for k in (key if isinstance(key, tuple) else (key,))):
            view_key = key
        # the trailing Ellipsis makes an integer key give a 0-d view, never a scalar read from memory
        return _tracer("indexing").view(self, lambda c: c[view_key])

    def __setitem__(self, key: Any, value: Any) -> None:
        _tracer("assignment").assign(self, key, value)

    # host reads: the values exist only on the device, at a later time
    def _host_read(self, what: str) -> Any:
        raise DataDependentError(
            f"{user_frame()}\n  {what} reads the value of a traced tensor on the host while blutrain.compiler "
            "traces this function; Python control flow that depends on tensor values cannot be compiled. "
            "Keep the value on the device (where, clamp, masked ops) or move this line out of the compiled "
            "function (e.g. read the returned loss after the call).")

    def item(self, *args: Any) -> Any:
        return self._host_read(".item()")

    def tolist(self) -> Any:
        return self._host_read(".tolist()")

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._host_read("a device-to-host copy")

    def __bool__(self) -> bool:
        return bool(self._host_read("bool(tensor)"))

    def __float__(self) -> float:
        return float(self._host_read("float(tensor)"))

    def __int__(self) -> int:
        return int(self._host_read("int(tensor)"))

    def __index__(self) -> int:
        return int(self._host_read("using a tensor as an index"))

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._host_read("converting to a NumPy array (or writing a traced value into an untraced array)")

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._host_read("__dlpack__")

    # Argument checks on the host (index bounds, class ids of a loss's target on the CPU) read the
    # values: the call's own values for an input (and views of one), which a probe proxy carries as
    # ``host``; for a value computed by a kernel, the result the traced call's check got (recorded, so
    # that the probe gives the same answer without the traced arrays).
    def _host_check(self, name: str, key: Any, read: Callable[[Any], Any]) -> Any:
        data = self.concrete if self.concrete is not None else self.host
        tr = _local.tracer
        if data is not None:
            result = read(data)
            if tr is not None and tr.mode == "trace" and self.concrete is not None and key is not None:
                tr.note_host_check(self.vid, name, key, result)
            return result
        recorded = None if tr is None or tr.recorded is None else tr.recorded
        found = None if recorded is None or key is None else recorded.host_checks.get((self.vid, name, key))
        if found is None:
            raise DataDependentError(
                f"{user_frame()}\n  {name} reads the values of a traced tensor (%{self.vid}) computed by the "
                "compiled function, on the host, and the traced call made no such read; only the function's "
                "inputs (and views of them) can be read by host-side checks on later calls")
        return found

    def min(self, *args: Any, **kwargs: Any) -> Any:
        return self._host_check("min", _check_key(args, kwargs), lambda a: a.min(*args, **kwargs))

    def max(self, *args: Any, **kwargs: Any) -> Any:
        return self._host_check("max", _check_key(args, kwargs), lambda a: a.max(*args, **kwargs))

    def __lt__(self, other: Any) -> Any:
        return self._host_check("<", _check_key((other,), {}), lambda a: a < other)

    def __le__(self, other: Any) -> Any:
        return self._host_check("<=", _check_key((other,), {}), lambda a: a <= other)

    def __gt__(self, other: Any) -> Any:
        return self._host_check(">", _check_key((other,), {}), lambda a: a > other)

    def __ge__(self, other: Any) -> Any:
        return self._host_check(">=", _check_key((other,), {}), lambda a: a >= other)

    def __eq__(self, other: object) -> Any:
        return self._host_check("==", _check_key((other,), {}), lambda a: a == other)

    def __ne__(self, other: object) -> Any:
        return self._host_check("!=", _check_key((other,), {}), lambda a: a != other)

    __hash__ = object.__hash__

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise TracingError(f"{user_frame()}\n  NumPy's {ufunc.__name__} was called on a traced array outside a "
                           "kernel; only dispatched kernels, views and astype can be traced")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.broadcast_to:
            return _trace_module.broadcast_to(*args, **kwargs)
        raise TracingError(f"{user_frame()}\n  numpy.{func.__name__} was called on a traced array outside a "
                           "kernel; only dispatched kernels, views and astype can be traced")


def _check_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A host check's arguments as a dict key, or None when they are not plain scalars (not recorded)."""
    items = (*args, *sorted(kwargs.items()))
    plain = (int, float, bool, str, type(None), np.integer, np.floating, np.bool_)

    def ok(x: Any) -> bool:
        return isinstance(x, plain) or (isinstance(x, tuple) and all(ok(v) for v in x))

    return items if all(ok(x) for x in items) else None


def _shell(value: Value) -> Any:
    """A NumPy array with ``value``'s shape, dtype and strides over no memory: views are computed on it
    (shape and stride arithmetic only), never its elements."""
    itemsize = value.dtype.itemsize
    return np.lib.stride_tricks.as_strided(np.empty(0, value.dtype.np), value.shape,
                                           tuple(s * itemsize for s in value.strides))


def _reshape(c: Any, shape: tuple[Any, ...]) -> Any:
    """``c.reshape(*shape)`` as a view, or None where that needs a copy (NumPy would copy: reading a
    shell's elements)."""
    if isinstance(c, np.ndarray):
        try:
            return c.reshape(*shape, copy=False)
        except ValueError:
            return None
    return c.reshape(*shape)


def _basic_key(key: Any, what: str) -> None:
    items = key if isinstance(key, tuple) else (key,)
    for k in items:
        if not (k is None or k is Ellipsis or isinstance(k, (int, slice, np.integer))):
            raise TracingError(f"{user_frame()}\n  {what} with a {type(k).__name__} key outside a kernel cannot "
                               "be traced")


def _tracer(what: str) -> Tracer:
    tr = _local.tracer
    if tr is None:
        raise TracingError(f"{what} on a traced array after its trace ended: a traced tensor escaped the compiled "
                           "function (keep tensors created inside it inside, or return them)")
    return tr


class _StrideTricks:
    @staticmethod
    def as_strided(x: Any, shape: Any = None, strides: Any = None, **kwargs: Any) -> Any:
        if not isinstance(x, TraceArray):
            raise TracingError("as_strided: expected a traced array")
        return _tracer("as_strided").view(
            x, lambda c: ARRAY_MODULES[type(c)].lib.stride_tricks.as_strided(c, shape, strides))


class _Lib:
    stride_tricks = _StrideTricks()


class _TraceModule:
    """What :func:`blutrain.tensor.backend.array_module` returns for a traced array: the few
    array-module functions op code calls outside kernels."""

    lib = _Lib()

    @staticmethod
    def broadcast_to(x: Any, shape: Any, **kwargs: Any) -> Any:
        if not isinstance(x, TraceArray):
            raise TracingError("broadcast_to: expected a traced array")
        return _tracer("broadcast_to").view(x, lambda c: ARRAY_MODULES[type(c)].broadcast_to(c, shape))

    def __getattr__(self, name: str) -> Any:
        raise TracingError(f"{user_frame()}\n  the array-module function {name!r} was called on a traced array "
                           "outside a kernel; only dispatched kernels, views and astype can be traced")


_trace_module = _TraceModule()
ARRAY_MODULES[TraceArray] = _trace_module  # type: ignore[assignment]


# -- the tracer ----------------------------------------------------------------------------------
def _arrays_equal(a: Any, b: Any) -> bool:
    xp = ARRAY_MODULES[type(a)]
    if a.dtype.kind == "f" or a.dtype.kind == "c" or a.dtype.name == "bfloat16":
        return bool(xp.array_equal(a, b, equal_nan=True))
    return bool(xp.array_equal(a, b))


# State arrays up to this size that kernels read are watched for writes by the host between two of
# them (per-step scalars); watching costs a copy held for the whole trace, so parameters are not.
_WATCHED_BYTES = 1024


class Tracer:
    """Records (``mode="trace"``) or replays and checks (``mode="probe"``) one function's calls."""

    def __init__(self, mode: str = "trace", recorded: Tracer | None = None) -> None:
        self.mode = mode
        self.values: list[Value] = []
        self.concrete: list[Any] = []  # vid → the real array of the trace (buffers and views)
        self.events: list[Event] = []
        self.state: dict[int, tuple[Any, int]] = {}  # id(allocation) → (allocation, vid)
        self.state_order: list[int] = []  # vids of state buffers, in order of first use
        self.state_vids: set[int] = set()
        self.watched: dict[tuple[Any, ...], Any] = {}  # a small state array → its value after its last kernel
        self.inputs: list[int] = []
        self.device: str | None = None
        self.recorded = recorded
        self.cursor = 0
        self.changed: dict[int, tuple[Any, ...]] = {}
        # (vid, check, arguments) → what a host-side check on a computed value read during the trace
        self.host_checks: dict[tuple[Any, ...], Any] = {}
        self.proxies: list[weakref.ref[TraceArray]] = []  # every proxy made while tracing
        # the operands the next kernel writes in place, all of them, as its caller declared (None: not declared)
        self.declared_writes: tuple[int, ...] | None = None
        # host work a replay repeats (blutrain.tensor.capture.per_call): (fn, guard, guard's value), in order
        self.per_calls: list[tuple[Callable[[], Any], Callable[[], Any], Any]] = []
        if recorded is not None:
            self.values, self.concrete, self.state = recorded.values, recorded.concrete, dict(recorded.state)
            self.state_order, self.inputs, self.device = list(recorded.state_order), recorded.inputs, recorded.device

    # values
    def _new_value(self, concrete: Any, root: int | None = None, offset: int = 0,
                   strides: tuple[int, ...] | None = None, keep: bool = True) -> int:
        """A new value described by ``concrete``. ``keep``: hold the array (inputs and state); a computed value's
        array lives only as long as its proxies (and views of it) do, as it would in eager mode, so that the
        trace holds no more memory than an eager call does."""
        vid = len(self.values)
        itemsize = concrete.dtype.itemsize
        st = tuple(s // itemsize for s in concrete.strides) if strides is None else strides
        self.values.append(Value(vid, tuple(concrete.shape), from_numpy_dtype(concrete.dtype),
                                 vid if root is None else root, offset, st))
        self.concrete.append(concrete if keep else None)
        return vid

    def _proxy(self, vid: int, concrete: Any) -> TraceArray:
        proxy = TraceArray(self.values[vid], concrete)
        self.proxies.append(weakref.ref(proxy))
        return proxy

    def add_input(self, concrete: Any) -> TraceArray:
        self._check_device(_device_of(concrete))
        vid = self._new_value(concrete)
        self.inputs.append(vid)
        return self._proxy(vid, concrete)

    def note_host_check(self, vid: int, name: str, key: Any, result: Any) -> None:
        """Keep what a host-side check read from a computed value (an input's are read anew on each call)."""
        if self.values[vid].root not in self.inputs:
            self.host_checks[(vid, name, key)] = result

    def release(self) -> None:
        """Drop every array of the traced call but the state: the inputs' buffers (the probe and the executor
        work from the values' descriptions; computed values were never held) and the data of every proxy still
        alive (one the function kept). The compiled graph's memory is then its state, its executor's buffers and
        its static inputs."""
        self.concrete[:] = [c if vid in self.state_vids else None for vid, c in enumerate(self.concrete)]
        for ref in self.proxies:
            proxy = ref()
            if proxy is not None:
                proxy.concrete = None
        self.proxies = []
        self.watched = {}

    def _check_device(self, dev: str) -> None:
        if self.device is None:
            self.device = dev
        elif dev != self.device:
            raise TracingError(f"{user_frame()}\n  the traced function uses arrays on {self.device} and on {dev}; "
                               "a compiled function runs on one device")

    def _resolve(self, a: Any) -> int:
        """The vid of an array argument: a proxy's own, or a state buffer (or a view of one)."""
        if isinstance(a, TraceArray):
            return a.vid
        memory = _memory(a)
        found = self.state.get(id(memory))
        if found is None:
            if self.mode == "probe":
                raise GraphBreakError(f"{user_frame()}\n  a kernel or collective read an array the traced call did "
                                      "not use: a parameter or buffer was replaced since the trace (call the "
                                      "compiled function's reset() after replacing model state), or the function "
                                      "made it outside kernels (empty(): use zeros() inside a compiled function)")
            owner = _root_array(a)
            self._check_device(_device_of(owner))
            vid = self._new_value(owner)
            self.state[id(memory)] = (memory, vid)
            self.state_order.append(vid)
            self.state_vids.add(vid)
        else:
            vid = found[1]
        owner = self.concrete[vid]
        if a is owner or (a.shape == owner.shape and a.strides == owner.strides and _ptr(a) == _ptr(owner)):
            return vid
        if a.dtype != owner.dtype:
            raise TracingError(f"{user_frame()}\n  a kernel read a {a.dtype} view of a {owner.dtype} array; "
                               "reinterpreting views cannot be traced")
        return self._view_event(vid, a, owner, 0)

    def _view_event(self, root: int, result: Any, base: Any, base_offset: int) -> int:
        """Record ``result`` (a real array inside the buffer ``root``) as a view of it; ``base`` is an array of
        the same buffer that starts ``base_offset`` elements into it (the root itself, or the view ``result``
        was made from: a computed root's own array is not held)."""
        itemsize = base.dtype.itemsize
        offset = base_offset + (_ptr(result) - _ptr(base)) // itemsize
        strides = tuple(s // itemsize for s in result.strides)
        template = (Operand(0), offset, tuple(result.shape), strides)
        if self.mode == "probe":
            ev = self._match("view", "view", template, [root])
            return ev.results[0]
        vid = self._new_value(result, root, offset, strides, keep=False)
        self._record(Event(len(self.events), "view", "view", self.device or "cpu", self.values[root].dtype.name,
                           template, [root], [vid], Operand(0)))
        return vid

    def _record(self, ev: Event) -> None:
        self.events.append(ev)

    def _match(self, kind: str, op: str, template: tuple[Any, ...], operands: list[int]) -> Event:
        """The recorded event at the cursor, checked against this call; changed scalars are noted."""
        assert self.recorded is not None
        events = self.recorded.events
        if self.cursor >= len(events):
            raise GraphBreakError(f"{user_frame()}\n  this call runs more ops than the traced one ({len(events)}); "
                                  "the compiled function must take the same path on every call")
        ev = events[self.cursor]
        self.cursor += 1
        if ev.kind != kind or ev.op != op or ev.operands != operands or len(ev.template) != len(template):
            raise GraphBreakError(f"{user_frame()}\n  op {self.cursor - 1} of this call is {op} on values "
                                  f"{operands}, the traced call had {ev.op} on {ev.operands}; the compiled "
                                  "function must take the same path on every call")
        changed = False
        for old, new in zip(ev.template, template, strict=True):
            if scalars_equal(old, new):
                continue
            if isinstance(old, (int, float)) and isinstance(new, (int, float)) and type(old) is type(new):
                changed = True  # a scalar argument (lr, step): the executor updates it
                continue
            raise GraphBreakError(f"{user_frame()}\n  op {self.cursor - 1} ({op}) of this call has argument {new!r} "
                                  f"where the traced call had {old!r}")
        if changed:
            self.changed[ev.uid] = template
        return ev

    # the argument encoding of a call: arrays become Operand markers
    def _template(self, args: Any, operands: list[int], concrete: list[Any]) -> Any:
        if isinstance(args, TraceArray) or _is_array(args):
            operands.append(self._resolve(args))
            concrete.append(args.concrete if isinstance(args, TraceArray) else args)
            return Operand(len(operands) - 1)
        if isinstance(args, tuple):
            return tuple(self._template(a, operands, concrete) for a in args)
        if isinstance(args, list):
            return [self._template(a, operands, concrete) for a in args]
        return args

    # intercepted operations
    def kernel(self, key: tuple[str, str, DType], fn: Kernel, args: tuple[Any, ...]) -> Any:
        op, device, dtype = key
        self._check_device(device)
        operands: list[int] = []
        concrete: list[Any] = []
        template = self._template(args, operands, concrete)
        declared, self.declared_writes = self.declared_writes, None
        if self.mode == "probe":
            ev = self._match("kernel", op, template, operands)
            return _rebuild(ev.ret, [TraceArray(self.values[v]) for v in ev.results])
        real_args = _substitute(template, concrete)
        self._check_host_writes(op, operands, concrete)  # the operands as the kernel will read them
        if declared is not None:
            # the caller said what the kernel writes (it may write unchanged values, a scale by 1): no copy of
            # every operand to compare (for an optimizer's step, all parameters and their state once more)
            out = fn(*real_args)
            writes = declared
        else:
            before = [c.copy() for c in concrete]
            out = fn(*real_args)
            writes = tuple(i for i, (b, c) in enumerate(zip(before, concrete, strict=True)) if not _arrays_equal(b, c))
            del before
        written = {self.values[operands[i]].root for i in writes}
        if written and self.watched:  # other views of what this kernel wrote hold new values legitimately
            self.watched = {k: v for k, v in self.watched.items() if k[0] not in written}
        for vid, c in zip(operands, concrete, strict=True):
            where = self._watch_key(vid, c)
            if where is not None:
                self.watched[where] = c.copy()
        owners = {id(_memory(c)) for c in concrete}
        results: list[int] = []
        proxies: list[TraceArray] = []
        ret = self._results(op, out, owners, results, proxies)
        # the event keeps no proxy: the results live as long as the function holds them
        self._record(Event(len(self.events), "kernel", op, device, dtype.name, tuple(template), operands, results,
                           ret, writes))
        return _rebuild(ret, proxies)

    def _results(self, op: str, x: Any, owners: set[int], results: list[int], proxies: list[TraceArray]) -> Any:
        """A kernel's return value with ``Operand(i)`` for its i-th array, each a new value (appended to
        ``results``, its proxy to ``proxies``). A method, not a closure: a recursive closure is a reference
        cycle, which would hold the results until the cyclic GC runs (it is off while tracing)."""
        if _is_array(x):
            if id(_memory(x)) in owners:
                raise TracingError(f"{user_frame()}\n  kernel {op!r} returned a view of one of its inputs; "
                                   "such kernels cannot be traced")
            vid = self._new_value(x, keep=False)
            results.append(vid)
            proxies.append(self._proxy(vid, x))
            return Operand(len(results) - 1)
        if isinstance(x, tuple):
            return tuple(self._results(op, v, owners, results, proxies) for v in x)
        if x is None:
            return None
        raise TracingError(f"{user_frame()}\n  kernel {op!r} returned a {type(x).__name__}; traced kernels "
                           "return arrays, tuples of arrays or None")

    def _watch_key(self, vid: int, array: Any) -> tuple[Any, ...] | None:
        """Where a small state array (or view: CuPy's allocation may be larger than the array) lies."""
        v = self.values[vid]
        if array.nbytes > _WATCHED_BYTES or v.root not in self.state_vids:
            return None
        return v.root, v.offset, v.shape, v.strides

    def _check_host_writes(self, op: str, operands: list[int], before: list[Any]) -> None:
        for vid, value in zip(operands, before, strict=True):
            key = self._watch_key(vid, value)
            seen = None if key is None else self.watched.get(key)
            if seen is not None and not _arrays_equal(seen, value):
                raise TracingError(
                    f"{user_frame()}\n  kernel {op!r} reads a state array (%{vid}, shape {tuple(value.shape)}) that "
                    "was written outside kernels (by the host) after an earlier kernel of this call had read it; a "
                    "compiled call replays the kernels only, so both would read the last values. Write such an "
                    "array (e.g. an optimizer's per-step scalars) once per call, before the first kernel that "
                    "reads it: one optimizer step per compiled call")

    def view(self, src: TraceArray, make: Callable[[Any], Any]) -> TraceArray:
        """A view op on a traced array (reshape, transpose, slicing, broadcast_to, as_strided)."""
        if self.mode == "probe":
            return self._probe_view(src, make)
        result = make(src.concrete)
        root = self.values[src.vid].root
        if not _is_array(result) or _memory(result) is not _memory(src.concrete):
            # NumPy copied (a reshape of a non-contiguous array): a copy kernel, then the view
            copied = self.copy(src)
            return self.view(copied, make)
        vid = self._view_event(root, result, src.concrete, src.value.offset)
        return self._proxy(vid, result)

    def _probe_view(self, src: TraceArray, make: Callable[[Any], Any]) -> TraceArray:
        """A view op of a later call, computed on ``src``'s description (a shell, no data) and matched with
        the traced one; a copy where the traced call copied (the next recorded op copies ``src``)."""
        assert self.recorded is not None
        events = self.recorded.events
        if self.cursor < len(events):
            ev = events[self.cursor]
            if ev.kind == "kernel" and ev.op == "copy" and ev.operands == [src.vid]:
                return self._probe_view(self.copy(src), make)
        shell = _shell(src.value)
        result = make(shell)
        if not _is_array(result) or _owner(result) is not _owner(shell):
            raise GraphBreakError(f"{user_frame()}\n  a view op of this call needs a copy of its operand (%{src.vid}) "
                                  "where the traced call's did not; the compiled function must take the same path "
                                  "on every call")
        itemsize = src.value.dtype.itemsize
        offset = src.value.offset + (_ptr(result) - _ptr(shell)) // itemsize
        shape = tuple(int(n) for n in result.shape)
        strides = tuple(s // itemsize for s in result.strides)
        root = src.value.root
        if self.cursor >= len(events):
            raise GraphBreakError(f"{user_frame()}\n  this call runs more ops than the traced one ({len(events)}); "
                                  "the compiled function must take the same path on every call")
        ev = events[self.cursor]
        if ev.kind != "view" or ev.operands != [root] or not _same_view(ev.template, offset, shape, strides):
            raise GraphBreakError(f"{user_frame()}\n  op {self.cursor} of this call is a view (offset {offset}, shape "
                                  f"{shape}, strides {strides}) of value {root}, the traced call had {ev.op} "
                                  f"{ev.template[1:] if ev.kind == 'view' else ''} on {ev.operands}; the compiled "
                                  "function must take the same path on every call")
        self.cursor += 1
        vid = ev.results[0]
        host = None
        if src.host is not None:  # an input's view: host-side checks read the call's own values
            host = make(src.host)
            host = host if _is_array(host) else None
        return TraceArray(self.values[vid], host=host)

    def cast(self, src: TraceArray, np_dtype: Any) -> TraceArray:
        dt = src.value.dtype
        out = dispatch.kernel("cast", self.device or "cpu", dt)(src, np.dtype(np_dtype))
        assert isinstance(out, TraceArray)
        return out

    def copy(self, src: TraceArray) -> TraceArray:
        dt = src.value.dtype
        out = dispatch.kernel("copy", self.device or "cpu", dt)(src)
        assert isinstance(out, TraceArray)
        return out

    def assign(self, target: Any, key: Any, value: Any) -> None:
        """``target[key] = value`` outside kernels; ``target`` a traced array, or state (or a view of it)."""
        _basic_key(key, "assigning into a traced array")
        operands: list[int] = []
        concrete: list[Any] = []
        template = self._template((target, key, value), operands, concrete)
        if self.mode == "probe":
            self._match("assign", "assign", template, operands)
            return
        concrete[0][key] = value.concrete if isinstance(value, TraceArray) else value
        root = self.values[operands[0]].root
        if self.watched:  # a recorded write: other views of its buffer hold new values legitimately
            self.watched = {k: v for k, v in self.watched.items() if k[0] != root}
        self._record(Event(len(self.events), "assign", "assign", self.device or "cpu",
                           self.values[operands[0]].dtype.name, template, operands, [], None, (0,)))

    def write(self, target: Any, value: Any) -> None:
        """The write-back of an in-place tensor op (blutrain.tensor.capture): an assignment."""
        self.assign(target, Ellipsis, value)

    # work outside kernels (blutrain.tensor.capture)
    def host_call(self, what: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """A collective of a group declared with ``blutrain.dist.traceable``: ``fn(*args)`` on the
        tensors in ``args``. Tracing: run it (tracing paused, traced tensors holding their real arrays)
        and record it. Probe: check it against the recorded one and make its version bumps; it runs when
        the compiled function issues it between its parts."""
        tensors: list[Tensor] = []
        arrays = _tensor_arrays(args, tensors)
        operands: list[int] = []
        concrete: list[Any] = []
        template = self._template(arrays, operands, concrete)  # walks args as _tensor_arrays did
        if self.mode == "probe":
            ev = self._match("collective", what, template, operands)
            if ev.uid in self.changed or ev.fn != fn:
                raise GraphBreakError(f"{user_frame()}\n  {what} of this call has arguments {template!r} (or another "
                                      f"group) where the traced call had {ev.template!r}; a compiled function issues "
                                      "the same collectives on every call")
            for i, n in ev.bumps:
                for _ in range(n):
                    tensors[i].bump_version()
            return
        for t in tensors:
            self._check_device(t.device.type)
        before = [c.copy() for c in concrete]
        self._check_host_writes(what, operands, before)
        versions = {id(t.storage): (i, t.version) for i, t in reversed(list(enumerate(tensors)))}
        swapped = [t for t in tensors if isinstance(t.array, TraceArray)]
        _local.tracer = None
        previous = capture.set_active(None)
        try:
            with capture.substitute_arrays(swapped, [t.array.concrete for t in swapped]):
                fn(*args)
        finally:
            capture.set_active(previous)
            _local.tracer = self
        writes = tuple(i for i, (b, c) in enumerate(zip(before, concrete, strict=True)) if not _arrays_equal(b, c))
        del before
        written = {self.values[operands[i]].root for i in writes}
        if written and self.watched:
            self.watched = {k: v for k, v in self.watched.items() if k[0] not in written}
        for vid, c in zip(operands, concrete, strict=True):
            where = self._watch_key(vid, c)
            if where is not None:
                self.watched[where] = c.copy()
        bumps = tuple((i, tensors[i].version - v) for i, v in versions.values() if tensors[i].version != v)
        metas = [(t.dtype, t.device) for t in tensors]

        def issue(real: list[Any]) -> None:
            made = [Tensor.from_array(a, dt, dev) for a, (dt, dev) in zip(real, metas, strict=True)]
            fn(*_substitute(template, made))

        dtype = tensors[0].dtype.name if tensors else ""
        self._record(Event(len(self.events), "collective", what, self.device or "cpu", dtype, template, operands, [],
                           None, writes, call=issue, fn=fn, bumps=bumps))

    def declare_writes(self, operands: tuple[int, ...]) -> None:
        """The next kernel writes these operands in place and no other (blutrain.tensor.capture): recorded as its
        writes, even where the values come out unchanged, without comparing copies."""
        self.declared_writes = tuple(sorted(set(operands)))

    def per_call(self, fn: Callable[[], Any], guard: Callable[[], Any], value: Any) -> None:
        """Host work that every replay runs again (an optimizer's step counts and device scalars): kept in
        order, in both modes (a probe's list replaces the traced one, with the guards' new values)."""
        self.per_calls.append((fn, guard, value))

    def refuse(self, what: str) -> NoReturn:
        raise TracingError(
            f"{user_frame()}\n  {what} was called while blutrain.compiler traces this function. A compiled call "
            "replays the recorded kernels only, so this collective would be skipped on every call after this one. "
            "A collective can be part of a compiled function only through a process group declared for it with "
            "blutrain.dist.traceable(group), which records it into the compiled function (the parallel "
            "modes declare theirs); otherwise call it outside the compiled function")


def _tensor_arrays(args: Any, tensors: list[Tensor]) -> Any:
    """``args`` with each tensor replaced by its array, the tensors appended to ``tensors`` in order."""
    if isinstance(args, Tensor):
        tensors.append(args)
        return args.array
    if isinstance(args, tuple):
        return tuple(_tensor_arrays(a, tensors) for a in args)
    if isinstance(args, list):
        return [_tensor_arrays(a, tensors) for a in args]
    return args


def _same_view(template: tuple[Any, ...], offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a recorded view event's ``(operand, offset, shape, strides)`` makes the same view: the stride of
    a dim of size 1 is never used (NumPy and CuPy may set it differently), nor anything of an empty view."""
    _, t_offset, t_shape, t_strides = template
    if tuple(t_shape) != shape:
        return False
    if 0 in shape:
        return True
    return t_offset == offset and all(a == b for a, b, n in zip(t_strides, strides, shape, strict=True) if n > 1)


def _substitute(template: Any, concrete: list[Any]) -> Any:
    if isinstance(template, Operand):
        return concrete[template.index]
    if isinstance(template, tuple):
        return tuple(_substitute(t, concrete) for t in template)
    if isinstance(template, list):
        return [_substitute(t, concrete) for t in template]
    return template


def _rebuild(ret: Any, proxies: list[TraceArray]) -> Any:
    if isinstance(ret, Operand):
        return proxies[ret.index]
    if isinstance(ret, tuple):
        return tuple(_rebuild(r, proxies) for r in ret)
    return ret


def _wrap_kernel(key: dispatch.KernelKey, fn: Kernel) -> Kernel:
    """The tracer's dispatch interceptor: ``fn`` recorded by this thread's tracer, run as is elsewhere."""
    def traced_kernel(*args: Any) -> Any:
        tr = _local.tracer
        if tr is None:
            return fn(*args)
        return tr.kernel(key, fn, args)

    traced_kernel.__name__ = f"traced_{key[0]}"
    return traced_kernel


_install_lock = threading.Lock()
_tracing_threads = 0  # threads inside tracing(); the first installs the interceptor, the last restores the previous
_previous_interceptor: dispatch.Interceptor | None = None


@contextmanager
def tracing(tracer: Tracer) -> Iterator[Tracer]:
    """Make ``tracer`` this thread's tracer and route every kernel of the table through it.

    The route is dispatch's interceptor (:func:`blutrain.tensor.dispatch.set_interceptor`): each kernel
    looked up meanwhile is the registered one in a recording wrapper. It stands in for any other
    interceptor (the debug mode's checks: a compiled function's kernels are the bare ones), which is back
    once no thread traces. Other threads keep running their kernels untouched (the wrappers pass through
    when their thread has no tracer). The cyclic garbage collector is off meanwhile: a finalizer it ran
    here (of an object the function never saw) would have its ops recorded into this function's graph, or
    be refused as the function's own data-dependent line.
    """
    global _tracing_threads, _previous_interceptor
    if _local.tracer is not None:
        raise TracingError("a compiled function was called while another one is being traced; nested "
                           "compilation is not supported")
    with _install_lock:
        if _tracing_threads == 0:
            _previous_interceptor = dispatch.set_interceptor(_wrap_kernel)
        _tracing_threads += 1
    _local.tracer = tracer
    previous = capture.set_active(tracer)
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield tracer
    finally:
        if collecting:
            gc.enable()
        _local.tracer = None
        capture.set_active(previous)
        with _install_lock:
            _tracing_threads -= 1
            if _tracing_threads == 0:
                dispatch.set_interceptor(_previous_interceptor)
                _previous_interceptor = None


__all__ = ["Event", "TraceArray", "Tracer", "Value", "active", "tracing", "user_frame"]
