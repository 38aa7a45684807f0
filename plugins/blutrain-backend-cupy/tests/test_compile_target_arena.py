"""The cuda compile target's executor, its arena flow on the CPU: a fake CuPy (pointers, pool, stream capture)
under a scripted launch list — record, place, serve, plan again when a run strays, fall back to no graph, give
memory back."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from blutrain.compiler.arena import aligned
from blutrain_backend_cupy.compile_target import CUDAGraphExecutor


class Mem:
    """A fake device allocation; ``on_free`` runs when it dies (CuPy's Memory/PooledMemory)."""

    def __init__(self, ptr: int, size: int, on_free: Callable[[], None] | None = None) -> None:
        self.ptr = ptr
        self.size = size
        self.on_free = on_free

    def __del__(self) -> None:
        if self.on_free is not None:
            self.on_free()


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        assert device_id >= 0  # given explicitly: no pointer query during capture
        self.ptr = ptr
        self.size = size
        self._owner = owner


class MemoryPointer:
    def __init__(self, mem: Any, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)


class Device:
    id = 0


class FakeCuda:
    """The parts of ``cupy.cuda`` the executor uses."""

    def __init__(self) -> None:
        self.next_address = 1 << 30
        self.allocator: Callable[[int], Any] | None = None  # using_allocator's, else the process's
        self.process_live = 0  # bytes the process's allocator has handed out and not got back
        self.capturing = False
        cuda = self

        class MemoryPool:
            def __init__(self) -> None:
                self.free: dict[int, list[int]] = {}  # size → addresses
                self.total = 0

            def malloc(self, n: int) -> MemoryPointer:
                size = -(-n // 512) * 512
                if self.free.get(size):
                    ptr = self.free[size].pop()
                else:
                    ptr = cuda.fresh(size)
                    self.total += size
                return MemoryPointer(Mem(ptr, size, lambda: self.free.setdefault(size, []).append(ptr)), 0)

            def total_bytes(self) -> int:
                return self.total

            def free_all_blocks(self) -> None:
                self.total -= sum(size * len(ptrs) for size, ptrs in self.free.items())
                self.free.clear()

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                pass

            def __enter__(self) -> Stream:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def begin_capture(self, mode: int) -> None:
                cuda.capturing = True

            def end_capture(self) -> object:
                cuda.capturing = False
                return types.SimpleNamespace(launch=lambda stream: None)

            def synchronize(self) -> None:
                pass

            def record(self) -> object:  # an event: the NumPy stand-in runs everything in order
                return object()

            def wait_event(self, event: object) -> None:
                pass

        self.MemoryPool = MemoryPool
        self.Stream = Stream
        self.MemoryPointer = MemoryPointer
        self.Device = Device
        self.memory = types.SimpleNamespace(UnownedMemory=UnownedMemory)
        self.runtime = types.SimpleNamespace(streamCaptureModeRelaxed=1)
        self.stream = Stream()

    def fresh(self, size: int) -> int:
        ptr = self.next_address
        self.next_address += size + 512
        return ptr

    def alloc(self, n: int) -> Any:
        if self.allocator is not None:
            return self.allocator(n)
        size = aligned(n)
        self.process_live += size

        def back() -> None:
            self.process_live -= size

        return MemoryPointer(Mem(self.fresh(size), size, back), 0)

    @contextmanager
    def using_allocator(self, fn: Callable[[int], Any]) -> Iterator[None]:
        previous, self.allocator = self.allocator, fn
        try:
            yield
        finally:
            self.allocator = previous

    def get_current_stream(self) -> Any:
        return self.stream


class Buffer:
    """A fake device array: its memory pointer, and a copy that comes from the process's allocator."""

    def __init__(self, cuda: FakeCuda, nbytes: int) -> None:
        self.cuda = cuda
        self.nbytes = nbytes
        self.data = cuda.alloc(nbytes)

    def copy(self, order: str = "C") -> Buffer:  # cupy.ndarray.copy's signature; the layout is not modelled
        return Buffer(self.cuda, self.nbytes)


class ScriptedProgram:
    """A launch list as the allocator sees it: each step allocates a slot's buffer or drops one; the last slot is
    the output. ``cache`` (bytes): the first run also allocates a buffer it keeps for good, as a kernel that
    makes its workspace on first use does. ``fail``: runs raise (a call that stream capture forbids)."""

    STEPS: tuple[tuple[str, int, int], ...] = (
        ("alloc", 1, 4000), ("alloc", 2, 1000), ("alloc", 3, 4000), ("free", 2, 0), ("alloc", 4, 300),
        ("free", 1, 0), ("alloc", 5, 8000), ("free", 3, 0), ("free", 4, 0), ("alloc", 6, 4), ("free", 5, 0),
    )

    def __init__(self, cuda: FakeCuda, cache: int = 0, fail: bool = False) -> None:
        self.cuda = cuda
        self.n_args = 1
        self.n_slots = 7
        self.slots: list[Any] = [None] * self.n_slots
        self.outputs = [6]
        self.cache = cache
        self.kept: list[Buffer] = []
        self.fail = fail
        self.runs = 0
        self.addresses: list[dict[int, tuple[int, int]]] = []  # per run: slot → (address, bytes)

    def drop_results(self) -> None:
        self.slots[self.n_args:] = [None] * (self.n_slots - self.n_args)

    def run(self) -> None:
        self.runs += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        if self.cache and not self.kept:
            self.kept.append(Buffer(self.cuda, self.cache))
        seen: dict[int, tuple[int, int]] = {}
        live: dict[int, tuple[int, int]] = {}
        for kind, slot, nbytes in self.STEPS:
            if kind == "alloc":
                buf = Buffer(self.cuda, nbytes)
                here = (buf.data.ptr, buf.data.ptr + aligned(nbytes))
                for other, (lo, hi) in live.items():
                    assert not (here[0] < hi and lo < here[1]), (slot, other)
                self.slots[slot] = buf
                live[slot] = seen[slot] = here
            else:
                self.slots[slot] = None
                del live[slot]
        self.addresses.append(seen)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    module = types.SimpleNamespace(cuda=fake, array=lambda a, copy=True: np.array(a, copy=True))
    monkeypatch.setitem(sys.modules, "cupy", module)
    # the stand-in has no cuda backend whose allocator cache the executor could empty
    monkeypatch.setattr("blutrain_backend_cupy.compile_target._release_cached", lambda: None)
    return fake


def _executor(cuda: FakeCuda, **kw: Any) -> tuple[CUDAGraphExecutor, ScriptedProgram]:
    program = ScriptedProgram(cuda, **kw)
    return CUDAGraphExecutor(program, [np.zeros(3)], []), program  # type: ignore[arg-type]


def test_the_kept_capture_runs_every_request_in_the_planned_arena(cuda: FakeCuda) -> None:
    executor, program = _executor(cuda)
    assert program.runs == 2  # the recording capture, then the kept one
    report = executor.report
    assert report is not None and executor.placement is not None
    assert report.requests == 6 and report.fallbacks == 0
    base = int(executor.arena.ptr)
    assert base % 256 == 0
    served = program.addresses[-1]
    for k, slot in enumerate(sorted(served)):  # slots are allocated in slot order in this script
        assert served[slot][0] == base + executor.placement.offsets[k]
    assert report.live_peak_bytes <= report.arena_bytes < report.request_bytes
    assert report.pool_bytes >= report.live_peak_bytes  # the recording pool held at least what was live
    assert executor.pool_bytes == 0  # emptied after the recording
    assert cuda.process_live >= report.arena_bytes  # the arena is the process allocator's


def test_run_copies_the_outputs_out_of_the_arena(cuda: FakeCuda) -> None:
    executor, program = _executor(cuda)
    arena = (int(executor.arena.ptr), int(executor.arena.ptr) + executor.arena_bytes)
    (out,) = executor.run([np.ones(3)])
    assert not arena[0] <= out.data.ptr < arena[1]
    assert program.runs == 2  # replays launch the graph, they do not run the list


def test_a_recapture_after_changed_scalars_reuses_the_arena(cuda: FakeCuda) -> None:
    executor, program = _executor(cuda)
    arena = int(executor.arena.ptr)
    executor.updated()
    executor.run([np.ones(3)])
    assert program.runs == 3 and executor.captures == 2
    assert int(executor.arena.ptr) == arena
    assert program.addresses[-1] == program.addresses[-2]
    assert executor.report is not None and executor.report.fallbacks == 0


def test_a_cache_made_by_the_recording_run_is_planned_away_by_a_second_plan(cuda: FakeCuda) -> None:
    executor, program = _executor(cuda, cache=2000)
    assert program.runs == 3  # record, serve (strayed: no cache request this time), serve again
    assert executor.captures == 1
    assert executor.report is not None and executor.report.fallbacks == 0 and executor.report.requests == 6
    assert program.kept  # the cache lives on, in the recording pool's memory
    assert executor.pool_bytes >= 2000


def test_a_failed_capture_runs_the_list_from_the_pool_without_an_arena(cuda: FakeCuda) -> None:
    executor, program = _executor(cuda, fail=True)
    assert executor.eager and executor.capture_error is not None
    assert executor.report is None and executor.arena is None and executor.arena_bytes == 0
    program.fail = False
    executor.run([np.ones(3)])
    assert program.runs == 2


def test_close_gives_the_arena_and_the_pool_back_and_refuses_to_run(cuda: FakeCuda) -> None:
    from blutrain.compiler import CompilerError

    before = cuda.process_live
    executor, program = _executor(cuda)
    executor.run([np.ones(3)])
    assert cuda.process_live > before
    executor.close()
    assert cuda.process_live == before  # arena, static inputs and results back to the process's allocator
    assert executor.pool_bytes == 0
    assert all(s is None for s in program.slots)
    with pytest.raises(CompilerError, match="closed"):
        executor.run([np.ones(3)])
    executor.close()  # twice is fine
