"""The "mpi" process group: BluTrain's collectives on CPU tensors through mpi4py.

Every operation is started as a non-blocking MPI call (``Iallreduce``, ``Ibcast``, ...) and completed
by polling its request against the group's deadline, so a rank whose peers died or hung raises
:class:`CollectiveTimeoutError` instead of blocking forever. Polling backs off from 10 µs to 1 ms, which
also keeps oversubscribed CPU runs (more ranks than cores) from starving each other.

Data moves as it is stored: a NumPy array of the tensor (staged through a contiguous copy where the
tensor is a strided view). MPI has no bfloat16/float16, so reductions of those go through float32;
everything that only moves data moves raw bytes.

MPI is finalized at exit only when the process ends cleanly: a rank leaving on an exception or
after a timeout must not wait in MPI_Finalize for peers that will never come.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np

from blutrain.dist import CollectiveTimeoutError, DistEnv, DistEnvironmentError, DistError, ReduceOp, Store, Work
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

Array = np.ndarray[Any, Any]
_NATIVE = {"float32", "float64", "int8", "int16", "int32", "int64", "uint8"}  # reducible by MPI as they are


class _Runtime:
    """Process-wide MPI state: imported once, finalized at exit only after a clean run."""

    mpi: Any = None
    clean = True


_runtime = _Runtime()


def _mpi() -> Any:
    if _runtime.mpi is None:
        import mpi4py

        mpi4py.rc.finalize = False  # we finalize ourselves, only when it cannot hang (see module doc)
        from mpi4py import MPI

        _runtime.mpi = MPI
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            _runtime.clean = False
            previous(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(_finalize)
    return _runtime.mpi


def _finalize() -> None:
    MPI = _runtime.mpi
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if _runtime.clean:
        MPI.Finalize()
        return
    # Without MPI_Finalize, MPICH leaves its node-local shared-memory segment in /dev/shm. Every peer
    # attached to it at MPI init, so removing the name now takes nothing from a rank still running.
    try:
        with open("/proc/self/maps") as maps:
            segments = {line.split()[-1] for line in maps if "/dev/shm/mpich_shm_" in line}
    except OSError:
        segments = set()
    for path in segments:
        with contextlib.suppress(OSError):
            os.unlink(path)


class MPIWork:
    """An MPI request plus what completes the operation (copying staged results back)."""

    def __init__(self, group: MPIProcessGroup, what: str, request: Any, finish: Callable[[], None] | None,
                 keep: tuple[Any, ...]) -> None:
        self.group, self.what, self.request, self.finish, self.keep = group, what, request, finish, keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.group._complete(self.request, self.what)
        self.done = True
        if self.finish is not None:
            self.finish()
        self.keep = ()

    def is_completed(self) -> bool:
        return self.done or bool(self.request.Test())


def _array(t: Tensor) -> Array:
    return t.array  # type: ignore[no-any-return]


def _bytes(a: Array) -> Array:
    """A contiguous array's bytes (any dtype, bfloat16 included) as uint8."""
    return a.reshape(-1).view(np.uint8)


class MPIProcessGroup:
    """A group of ranks over one MPI communicator (``COMM_WORLD`` for the default group)."""

    backend = "mpi"

    def __init__(self, comm: Any, timeout: float, name: str = "world") -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.timeout = float(timeout)
        self.name = name
        self._broken: str | None = None
        self._splits = 0

    def __repr__(self) -> str:
        return f"MPIProcessGroup({self.name}, rank {self.rank} of {self.size}, timeout {self.timeout:g} s)"

    # ------------------------------------------------------------------------------ completion
    def _check_usable(self, what: str) -> None:
        if self._broken is not None:
            raise DistError(f"{what}: the mpi group {self.name} is unusable after an earlier failure: {self._broken}")
        if self.comm is None:
            raise DistError(f"{what}: the mpi group {self.name} was destroyed")

    def _complete(self, request: Any, what: str) -> None:
        if request.Test():
            return
        deadline = time.monotonic() + self.timeout
        delay = 1e-5
        while not request.Test():
            if time.monotonic() > deadline:
                self._broken = (f"{what} timed out on rank {self.rank} of {self.size} (group {self.name}) after "
                                f"{self.timeout:g} s")
                _runtime.clean = False
                raise CollectiveTimeoutError(
                    f"{self._broken}: not every rank joined it; another rank may have died, hung, or called a "
                    "different collective. The group cannot be used any more.")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _run(self, what: str, request: Any, finish: Callable[[], None] | None, async_op: bool,
             *keep: Any) -> Work | None:
        work = MPIWork(self, what, request, finish, keep)
        if async_op:
            return work
        work.wait()
        return None

    # ------------------------------------------------------------------------------ staging
    @staticmethod
    def _writable(t: Tensor, reduce_dtype: bool) -> tuple[Array, Callable[[], None]]:
        """An array MPI may write the result of ``t`` into, and what copies it back into ``t``."""
        a = _array(t)
        staged = reduce_dtype and a.dtype.name not in _NATIVE
        if not staged and a.flags.c_contiguous:
            return a, t.bump_version
        buf = a.astype(np.float32) if staged else np.ascontiguousarray(a)

        def back() -> None:
            a[...] = buf.astype(a.dtype, copy=False) if staged else buf
            t.bump_version()

        return buf, back

    @staticmethod
    def _readable(t: Tensor, reduce_dtype: bool) -> Array:
        a = _array(t)
        if reduce_dtype and a.dtype.name not in _NATIVE:
            return a.astype(np.float32)
        return np.ascontiguousarray(a)

    def _mpi_op(self, op: str) -> Any:
        MPI = _mpi()
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]

    def _then_avg(self, op: str, buf: Array, back: Callable[[], None]) -> Callable[[], None]:
        if op != "avg":
            return back
        size = self.size

        def finish() -> None:
            np.divide(buf, size, out=buf, casting="unsafe")
            back()

        return finish

    # ------------------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Work | None:
        check_tensor("all_reduce", "tensor", tensor, "cpu")
        check_op("all_reduce", op, tensor)
        self._check_usable("all_reduce")
        buf, back = self._writable(tensor, True)
        req = self.comm.Iallreduce(_mpi().IN_PLACE, buf, op=self._mpi_op(op))
        return self._run("all_reduce", req, self._then_avg(op, buf, back), async_op, buf)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = "sum",
                       async_op: bool = False) -> Work | None:
        check_tensor("reduce_scatter", "output", output, "cpu")
        check_tensor("reduce_scatter", "input", input, "cpu")
        check_op("reduce_scatter", op, input)
        check_same("reduce_scatter", output, input, scattered_shape("reduce_scatter", input, self.size))
        self._check_usable("reduce_scatter")
        send = self._readable(input, True)
        buf, back = self._writable(output, True)
        req = self.comm.Ireduce_scatter_block(send, buf, op=self._mpi_op(op))
        return self._run("reduce_scatter", req, self._then_avg(op, buf, back), async_op, send, buf)

    def all_gather_into_tensor(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        check_tensor("all_gather_into_tensor", "output", output, "cpu")
        check_tensor("all_gather_into_tensor", "input", input, "cpu")
        check_same("all_gather_into_tensor", output, input,
                   gathered_shape("all_gather_into_tensor", input, self.size))
        self._check_usable("all_gather_into_tensor")
        send = self._readable(input, False)
        buf, back = self._writable(output, False)
        req = self.comm.Iallgather(_bytes(send), _bytes(buf))
        return self._run("all_gather_into_tensor", req, back, async_op, send, buf)

    def all_gather(self, outputs: list[Tensor], input: Tensor, async_op: bool = False) -> Work | None:
        check_tensor("all_gather", "input", input, "cpu")
        check_list("all_gather", outputs, input, self.size, "cpu")
        self._check_usable("all_gather")
        send = self._readable(input, False)
        buf = np.empty((self.size, *send.shape), dtype=send.dtype)
        req = self.comm.Iallgather(_bytes(send), _bytes(buf))

        def finish() -> None:
            for r, out in enumerate(outputs):
                _array(out)[...] = buf[r]
                out.bump_version()

        return self._run("all_gather", req, finish, async_op, send, buf)

    def broadcast(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        check_tensor("broadcast", "tensor", tensor, "cpu")
        check_rank("broadcast", "src", src, self.size)
        self._check_usable("broadcast")
        buf, back = self._writable(tensor, False)
        req = self.comm.Ibcast(_bytes(buf), root=src)
        return self._run("broadcast", req, None if self.rank == src else back, async_op, buf)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        check_tensor("all_to_all", "output", output, "cpu")
        check_tensor("all_to_all", "input", input, "cpu")
        scattered_shape("all_to_all", input, self.size)
        check_same("all_to_all", output, input, tuple(input.shape))
        self._check_usable("all_to_all")
        send = self._readable(input, False)
        buf, back = self._writable(output, False)
        req = self.comm.Ialltoall(_bytes(send), _bytes(buf))
        return self._run("all_to_all", req, back, async_op, send, buf)

    def send(self, tensor: Tensor, dst: int, async_op: bool = False) -> Work | None:
        check_tensor("send", "tensor", tensor, "cpu")
        check_rank("send", "dst", dst, self.size)
        self._check_usable("send")
        send = self._readable(tensor, False)
        req = self.comm.Isend(_bytes(send), dest=dst, tag=0)
        return self._run(f"send to rank {dst}", req, None, async_op, send)

    def recv(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        check_tensor("recv", "tensor", tensor, "cpu")
        check_rank("recv", "src", src, self.size)
        self._check_usable("recv")
        buf, back = self._writable(tensor, False)
        req = self.comm.Irecv(_bytes(buf), source=src, tag=0)
        return self._run(f"recv from rank {src}", req, back, async_op, buf)

    def barrier(self) -> None:
        check_not_captured("barrier")
        self._check_usable("barrier")
        self._complete(self.comm.Ibarrier(), "barrier")

    def split(self, color: int, key: int) -> MPIProcessGroup:
        check_not_captured("split")
        self._check_usable("split")
        # MPI_Comm_split has no non-blocking form: a timed barrier first, so a missing rank is a
        # timeout here rather than a hang inside the split
        self._complete(self.comm.Ibarrier(), "split")
        self._splits += 1
        return MPIProcessGroup(self.comm.Split(int(color), int(key)), self.timeout,
                               f"{self.name}/split{self._splits}:{color}")

    def destroy(self) -> None:
        comm, self.comm = self.comm, None
        MPI = _runtime.mpi
        if comm is not None and MPI is not None and comm != MPI.COMM_WORLD and self._broken is None:
            comm.Free()


def create_group(rank: int, world_size: int, store: Store | None, timeout: float, env: DistEnv | None = None,
                 **options: Any) -> MPIProcessGroup:
    """The factory registered as "mpi": the group of every process of MPI_COMM_WORLD."""
    if options:
        raise DistError(f"init_process_group(backend='mpi'): unknown options {', '.join(sorted(options))}")
    MPI = _mpi()
    world = MPI.COMM_WORLD
    source = env.source if env is not None else "the environment"
    if world.Get_size() != world_size or world.Get_rank() != rank:
        raise DistEnvironmentError(
            f"mpi: MPI sees rank {world.Get_rank()} of {world.Get_size()}, but {source} says rank {rank} of "
            f"{world_size}; start the job with `blutrain run -n N` or `mpiexec -n N` so that MPI and BluTrain "
            "agree")
    return MPIProcessGroup(world.Dup(), timeout)


__all__ = ["MPIProcessGroup", "MPIWork", "create_group"]
