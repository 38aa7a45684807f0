"""The "nccl" process group: BluTrain's collectives on CUDA tensors through ``cupy.cuda.nccl``.

Bootstrap: rank 0 of a group creates the NCCL unique id and publishes it in the job's store
(``blutrain run``'s, or rank 0's at MASTER_ADDR:MASTER_PORT); the others read it from there.

Ordering: every group owns a communication stream. A collective first makes that stream wait for
an event recorded on the caller's current stream (its inputs are ready), runs there, and records a
``done`` event; a synchronous call then makes the current stream wait for ``done`` — compute after
the call is ordered after the collective without blocking the host. ``async_op=True`` returns a work
whose ``wait()`` does that later, so communication overlaps compute in between. Tensors stay
referenced until their collective has finished, so the allocator cannot hand their memory out early.

CUDA graphs: a collective issued while the current stream is being captured (a compiled step) becomes nodes of
the graph: the same events order it, and each replay of the graph runs it. Such a collective is not given to the
watchdog (an event recorded into a capture cannot be queried); a hang inside a replayed graph shows at the next
collective issued outside it, which waits behind the graph. NCCL counts the graphs that hold a communicator's
collectives and ``ncclCommDestroy`` waits until every one of them is destroyed: release compiled functions that
captured the group's collectives (``CompiledFunction.reset()``, or drop them) before :meth:`destroy`.

Timeout: a watchdog thread checks the ``done`` events of collectives in flight; one that is not
done within the group's timeout aborts the communicator (NCCL kernels return), prints a
CollectiveTimeoutError naming the operation and rank, and ends the process with exit code 1 (as
torch's NCCL watchdog tears the process down), since the host thread may be blocked in a CUDA call
that cannot raise. ``blutrain run`` then stops the other ranks and reports it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from blutrain.dist import (
    CollectiveTimeoutError,
    DistArgumentError,
    DistEnv,
    DistEnvironmentError,
    DistError,
    ReduceOp,
    Store,
    Work,
)
from blutrain.dist.process_group import (
    check_list,
    check_not_captured,
    check_op,
    check_rank,
    check_same,
    check_tensor,
    gathered_shape,
    scattered_shape,
)
from blutrain.tensor import Tensor


def require_cupy() -> Any:
    """The cupy module (whose ``cupy.cuda.nccl`` binding this plugin drives) with a visible GPU, or
    DistEnvironmentError saying what is missing."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy built for another CUDA failing to load
        raise DistEnvironmentError(f"backend 'nccl' needs CuPy with NCCL, which does not load ({exc}); install "
                                   "blutrain-comm-nccl[cuda12] or blutrain-comm-nccl[cuda13], or use backend 'mpi' "
                                   "on CPUs") from None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        raise DistEnvironmentError(f"backend 'nccl' needs a CUDA GPU, and CuPy sees none ({exc}); use backend "
                                   "'mpi' on CPUs") from None
    if not count:
        raise DistEnvironmentError("backend 'nccl' needs a CUDA GPU, and CuPy sees 0 devices; use backend 'mpi' on "
                                   "CPUs")
    return cupy


# ncclDataType_t and ncclRedOp_t values (nccl.h); AVG needs NCCL >= 2.10
_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_OPS = {"sum": 0, "max": 2, "min": 3, "avg": 4}
_BYTES = 1  # ncclUint8: data that is only moved goes as bytes, whatever its dtype


class NCCLWork:
    """A collective in flight on the group's stream."""

    def __init__(self, group: NCCLProcessGroup, what: str, done: Any, keep: tuple[Any, ...],
                 finish: Callable[[], None] | None, issued_on: int) -> None:
        self.group, self.what, self.done, self.keep, self.finish = group, what, done, keep, finish
        self.issued_on = issued_on  # the stream the collective was ordered after
        self.deadline = time.monotonic() + group.timeout
        self.waited = False

    def wait(self) -> None:
        """Order the current stream after the collective (the host does not block). Waited on the stream
        it was issued from, the tensors it kept alive are let go: memory freed from here on is reused by
        work of that stream, ordered after the collective. (The watchdog keeps the work itself until it
        completes, seen at its next poll; holding the tensors that long would keep alive every buffer of up to
        a poll interval, 0.1 s, a ZeRO-3 forward's gathered parameters among them.)"""
        if self.waited:
            return
        self.group._raise_if_broken(self.what)
        current = self.group.cp.cuda.get_current_stream()
        current.wait_event(self.done)
        self.waited = True
        if current.ptr == self.issued_on:
            self.keep = ()
        if self.finish is not None:
            self.finish()

    def is_completed(self) -> bool:
        return bool(self.done.done)


# An overlapped collective of at least this many bytes runs long enough beside compute for its SMs to matter.
RESERVE_MIN_BYTES = 2**20


def reserve_requested_by_env() -> tuple[int, int] | None:
    """``BLUTRAIN_NCCL_RESERVE_SMS=SMS:PRODUCTS``: after launching an overlapped collective of at least 1 MiB
    (``async_op``, or captured into a compiled step, which forks it beside the compute after it), the group asks
    the tensors' backend to plan the next PRODUCTS matrix products on the device for SMS fewer SMs
    (``Backend.reserve_sms``): NCCL's kernel holds one SM per channel while it runs, and a GEMM planned for every
    SM would leave part of its grid to a second wave. Unset: no reservation."""
    raw = os.environ.get("BLUTRAIN_NCCL_RESERVE_SMS", "")
    if not raw:
        return None
    sms, _, products = raw.partition(":")
    if not (sms.isdigit() and products.isdigit()):
        raise DistEnvironmentError(f"BLUTRAIN_NCCL_RESERVE_SMS must be SMS:PRODUCTS (two counts, e.g. 24:3), got "
                                   f"{raw!r}; unset it to plan GEMMs for every SM")
    return int(sms), int(products)


def unique_id_bytes(uid: bytes | Sequence[int]) -> bytes:
    """The NCCL unique id as its 128 raw bytes: CuPy 14 returns it as bytes, earlier CuPy as a tuple of C
    ``char`` values (signed on x86), and the store carries bytes either way."""
    return bytes(uid) if isinstance(uid, bytes) else bytes(value & 0xFF for value in uid)


def communicator(nccl: Any, size: int, raw_id: bytes, rank: int) -> Any:
    """``NcclCommunicator`` from the raw id rank 0 published, in the form this CuPy takes: bytes (CuPy 14), or
    else the tuple of signed ``char`` values that its ``get_unique_id`` returns."""
    try:
        return nccl.NcclCommunicator(size, raw_id, rank)
    except TypeError:
        return nccl.NcclCommunicator(size, tuple(b - 256 if b > 127 else b for b in raw_id), rank)


class NCCLProcessGroup:
    """``size`` ranks over one NCCL communicator on this process's current CUDA device."""

    backend = "nccl"

    def __init__(self, rank: int, size: int, store: Store, timeout: float, name: str = "world",
                 abort_on_timeout: bool = True) -> None:
        cp = require_cupy()
        from cupy.cuda import nccl

        self.cp, self.nccl = cp, nccl
        self.rank, self.size, self.timeout, self.name = rank, size, float(timeout), name
        self.store = store
        self.abort_on_timeout = abort_on_timeout
        self.device: int = cp.cuda.Device().id
        key = f"blutrain/nccl/{name}/id"
        if rank == 0:
            raw = unique_id_bytes(nccl.get_unique_id())
            store.set(key, raw)
        else:
            raw = store.get(key, timeout=self.timeout)
        self.comm: Any = communicator(nccl, size, raw, rank)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._broken: str | None = None
        self._captured = False  # a collective of this group was captured into a CUDA graph
        self._splits = 0
        self._inflight: list[NCCLWork] = []
        self._lock = threading.Lock()
        self._closed = False
        self.reserve = reserve_requested_by_env()
        threading.Thread(target=self._watchdog, name=f"blutrain-nccl-watchdog-{name}", daemon=True).start()

    def __repr__(self) -> str:
        return f"NCCLProcessGroup({self.name}, rank {self.rank} of {self.size}, cuda:{self.device})"

    # ------------------------------------------------------------------------------ timeout
    def _watchdog(self) -> None:
        while not self._closed:
            time.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                self._inflight = [w for w in self._inflight if not w.done.done]
                late = next((w for w in self._inflight if now > w.deadline), None)
            if late is None:
                continue
            self._broken = (f"{late.what} timed out on rank {self.rank} of {self.size} (nccl group {self.name}) "
                            f"after {self.timeout:g} s: not every rank joined it; another rank may have died, hung, "
                            "or called a different collective")
            with contextlib.suppress(Exception):  # aborting a communicator that already failed
                self.comm.abort()
            if self.abort_on_timeout:
                print(f"blutrain.dist.errors.CollectiveTimeoutError: {self._broken}", file=sys.stderr, flush=True)
                os._exit(1)
            return

    def _raise_if_broken(self, what: str) -> None:
        if self._broken is not None:
            raise CollectiveTimeoutError(f"{what}: the nccl group is unusable: {self._broken}")
        if self.comm is None:
            raise DistError(f"{what}: the nccl group {self.name} was destroyed")

    # ------------------------------------------------------------------------------ launching
    def _check(self, op: str, argument: str, t: object) -> Tensor:
        tensor = check_tensor(op, argument, t, "cuda")
        if not tensor.is_contiguous():
            raise DistArgumentError(f"{op}: {argument} must be contiguous for nccl, got strides of a view; pass "
                                    ".contiguous() and copy the result back")
        if tensor.device.index != self.device:
            raise DistArgumentError(f"{op}: {argument} is on {tensor.device}, but this rank's nccl group uses "
                                    f"cuda:{self.device}")
        return tensor

    def _dtype(self, op: str, t: Tensor) -> int:
        code = _DTYPES.get(t.dtype.name)
        if code is None:
            raise DistArgumentError(f"{op}: nccl cannot reduce dtype {t.dtype.name}; supported: "
                                    f"{', '.join(_DTYPES)}")
        return code

    def _launch(self, what: str, call: Callable[[int], None], keep: tuple[Any, ...], async_op: bool,
                finish: Callable[[], None] | None = None) -> Work | None:
        self._raise_if_broken(what)
        cp = self.cp
        current = cp.cuda.get_current_stream()
        capturing = current.is_capturing()  # a compiled step's collective: forked beside the compute after it
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(current)
        self.stream.wait_event(ready)
        call(self.stream.ptr)
        beside = async_op or capturing
        if self.reserve is not None and beside and sum(t.nbytes for t in keep) >= RESERVE_MIN_BYTES:
            keep[0].device.backend.reserve_sms(self.device, *self.reserve)
        done = cp.cuda.Event(disable_timing=True)
        done.record(self.stream)
        work = NCCLWork(self, what, done, keep, finish, current.ptr)
        if capturing:
            self._captured = True
        else:
            with self._lock:
                self._inflight.append(work)
        if async_op:
            return work
        work.wait()
        return None

    @contextlib.contextmanager
    def _grouped(self) -> Iterator[None]:
        """NCCL calls launched as one group (one kernel; a send and a recv with peers posted together)."""
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    # ------------------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Work | None:
        t = self._check("all_reduce", "tensor", tensor)
        check_op("all_reduce", op, t)
        dtype, n, ptr = self._dtype("all_reduce", t), t.numel(), t.data_ptr()

        def call(stream: int) -> None:
            self.comm.allReduce(ptr, ptr, n, dtype, _OPS[op], stream)

        t.bump_version()
        return self._launch("all_reduce", call, (t,), async_op)

    def all_reduce_coalesced(self, tensors: list[Tensor], op: ReduceOp = "sum",
                             async_op: bool = False) -> Work | None:
        """Every tensor all-reduced in place, the reductions grouped into one NCCL launch (no flat copy)."""
        ts = [self._check("all_reduce_coalesced", f"tensors[{i}]", t) for i, t in enumerate(tensors)]
        for t in ts:
            check_op("all_reduce_coalesced", op, t)
        calls = [(self._dtype("all_reduce_coalesced", t), t.numel(), t.data_ptr()) for t in ts]

        def call(stream: int) -> None:
            with self._grouped():
                for dtype, n, ptr in calls:
                    self.comm.allReduce(ptr, ptr, n, dtype, _OPS[op], stream)

        for t in ts:
            t.bump_version()
        return self._launch("all_reduce_coalesced", call, tuple(ts), async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = "sum",
                       async_op: bool = False) -> Work | None:
        out, inp = self._check("reduce_scatter", "output", output), self._check("reduce_scatter", "input", input)
        check_op("reduce_scatter", op, inp)
        check_same("reduce_scatter", out, inp, scattered_shape("reduce_scatter", inp, self.size))
        dtype, n = self._dtype("reduce_scatter", inp), out.numel()
        src, dst = inp.data_ptr(), out.data_ptr()

        def call(stream: int) -> None:
            self.comm.reduceScatter(src, dst, n, dtype, _OPS[op], stream)

        out.bump_version()
        return self._launch("reduce_scatter", call, (out, inp), async_op)

    def all_gather_into_tensor(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        out = self._check("all_gather_into_tensor", "output", output)
        inp = self._check("all_gather_into_tensor", "input", input)
        check_same("all_gather_into_tensor", out, inp, gathered_shape("all_gather_into_tensor", inp, self.size))
        n, src, dst = inp.numel() * inp.dtype.itemsize, inp.data_ptr(), out.data_ptr()

        def call(stream: int) -> None:
            self.comm.allGather(src, dst, n, _BYTES, stream)

        out.bump_version()
        return self._launch("all_gather_into_tensor", call, (out, inp), async_op)

    def all_gather(self, outputs: list[Tensor], input: Tensor, async_op: bool = False) -> Work | None:
        inp = self._check("all_gather", "input", input)
        check_list("all_gather", outputs, inp, self.size, "cuda")
        from blutrain.tensor import empty

        flat = empty(self.size * inp.numel(), dtype=inp.dtype, device=inp.device)
        n, src, dst = inp.numel() * inp.dtype.itemsize, inp.data_ptr(), flat.data_ptr()

        def call(stream: int) -> None:
            self.comm.allGather(src, dst, n, _BYTES, stream)

        def finish() -> None:  # on the current stream, after it waited for the gather
            for r, out in enumerate(outputs):
                out.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(*inp.shape))

        return self._launch("all_gather", call, (flat, inp), async_op, finish)

    def broadcast(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        t = self._check("broadcast", "tensor", tensor)
        check_rank("broadcast", "src", src, self.size)
        n, ptr = t.numel() * t.dtype.itemsize, t.data_ptr()

        def call(stream: int) -> None:
            self.comm.broadcast(ptr, ptr, n, _BYTES, src, stream)

        t.bump_version()
        return self._launch("broadcast", call, (t,), async_op)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        out, inp = self._check("all_to_all", "output", output), self._check("all_to_all", "input", input)
        scattered_shape("all_to_all", inp, self.size)
        check_same("all_to_all", out, inp, tuple(inp.shape))
        block = inp.numel() * inp.dtype.itemsize // self.size
        src, dst = inp.data_ptr(), out.data_ptr()

        def call(stream: int) -> None:
            with self._grouped():
                for peer in range(self.size):
                    self.comm.send(src + peer * block, block, _BYTES, peer, stream)
                    self.comm.recv(dst + peer * block, block, _BYTES, peer, stream)

        out.bump_version()
        return self._launch("all_to_all", call, (out, inp), async_op)

    def send(self, tensor: Tensor, dst: int, async_op: bool = False) -> Work | None:
        t = self._check("send", "tensor", tensor)
        check_rank("send", "dst", dst, self.size)
        n, ptr = t.numel() * t.dtype.itemsize, t.data_ptr()

        def call(stream: int) -> None:
            self.comm.send(ptr, n, _BYTES, dst, stream)

        return self._launch(f"send to rank {dst}", call, (t,), async_op)

    def recv(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        t = self._check("recv", "tensor", tensor)
        check_rank("recv", "src", src, self.size)
        n, ptr = t.numel() * t.dtype.itemsize, t.data_ptr()

        def call(stream: int) -> None:
            self.comm.recv(ptr, n, _BYTES, src, stream)

        t.bump_version()
        return self._launch(f"recv from rank {src}", call, (t,), async_op)

    def sendrecv(self, send: Tensor, dst: int, recv: Tensor, src: int, async_op: bool = False) -> Work | None:
        """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` in one NCCL group
        (:func:`blutrain.dist.sendrecv`): a recv and a send launched one after the other on this group's
        stream would each wait for a peer whose matching send is queued behind its own recv."""
        out, inp = self._check("sendrecv", "recv", recv), self._check("sendrecv", "send", send)
        check_rank("sendrecv", "dst", dst, self.size)
        check_rank("sendrecv", "src", src, self.size)
        n_out, n_in = out.numel() * out.dtype.itemsize, inp.numel() * inp.dtype.itemsize
        dst_ptr, src_ptr = out.data_ptr(), inp.data_ptr()

        def call(stream: int) -> None:
            with self._grouped():
                self.comm.send(src_ptr, n_in, _BYTES, dst, stream)
                self.comm.recv(dst_ptr, n_out, _BYTES, src, stream)

        out.bump_version()
        return self._launch(f"sendrecv to rank {dst} from rank {src}", call, (out, inp), async_op)

    def barrier(self) -> None:
        """An all-reduce of one element, then the host waits for it (bounded by the watchdog)."""
        check_not_captured("barrier")
        from blutrain.tensor import zeros

        token = zeros(1, device=f"cuda:{self.device}")
        self.all_reduce(token)
        self.cp.cuda.get_current_stream().synchronize()
        self._raise_if_broken("barrier")

    def split(self, color: int, key: int) -> NCCLProcessGroup:
        """Members are exchanged through the store: each rank posts (color, key), reads everyone's,
        and joins a new communicator with the others of its color."""
        check_not_captured("split")
        self._raise_if_broken("split")
        self._splits += 1
        base = f"blutrain/nccl/{self.name}/split{self._splits}"
        self.store.set(f"{base}/member/{self.rank}", f"{int(color)},{int(key)}".encode())
        posted = []
        for r in range(self.size):
            c, k = self.store.get(f"{base}/member/{r}", timeout=self.timeout).decode().split(",")
            posted.append((int(c), int(k), r))
        members = sorted((k, r) for c, k, r in posted if c == int(color))
        new_rank = [r for _, r in members].index(self.rank)
        return NCCLProcessGroup(new_rank, len(members), self.store, self.timeout,
                                f"{self.name}.{self._splits}.{int(color)}", self.abort_on_timeout)

    def destroy(self) -> None:
        """Free the communicator (waiting for its work). A CUDA graph that captured its collectives must be
        destroyed first (see the module doc): unreferenced ones are collected here before NCCL waits for them."""
        self._closed = True
        comm, self.comm = self.comm, None
        if comm is not None and self._broken is None:
            self.stream.synchronize()
            if self._captured:
                gc.collect()  # a compiled step dropped in a reference cycle still holds its graph until collected
            comm.destroy()


def create_group(rank: int, world_size: int, store: Store | None, timeout: float, env: DistEnv | None = None,
                 **options: Any) -> NCCLProcessGroup:
    """The factory registered as "nccl": binds this process to GPU ``LOCAL_RANK`` (modulo the visible
    GPUs) and joins the job's communicator. ``abort_on_timeout=False`` keeps the process alive after a
    timeout (the next call raises CollectiveTimeoutError instead)."""
    unknown = set(options) - {"abort_on_timeout"}
    if unknown:
        raise DistError(f"init_process_group(backend='nccl'): unknown options {', '.join(sorted(unknown))}")
    if store is None:
        raise DistError("init_process_group(backend='nccl'): the NCCL unique id is exchanged through a store, and none "
                        "is known; start with `blutrain run -n N` or set MASTER_ADDR and MASTER_PORT")
    cp = require_cupy()
    local = env.local_rank if env is not None else rank
    cp.cuda.Device(local % cp.cuda.runtime.getDeviceCount()).use()
    return NCCLProcessGroup(rank, world_size, store, timeout, abort_on_timeout=bool(options.get("abort_on_timeout",
                                                                                                True)))


__all__ = ["NCCLProcessGroup", "NCCLWork", "create_group"]
