"""One planned arena for a captured step: its allocation requests recorded once, placed by liveness, served.

A compiled step's launch list is deterministic, and so is the sequence of allocation requests its kernels
make while it runs (their outputs, their scratch, a library's workspace) and the point where each one is
freed: CuPy frees an allocation when the last array on it dies, the program drops every slot right after its
last reader, and the executor keeps Python's cyclic garbage collector off during the run, so that reference
counts alone decide. The CUDA executor therefore runs the list three ways:

1. :class:`RecordingRun` — a capture whose requests come from a private pool, logging each request's size
   and when it was freed;
2. :func:`place` — an offset for every request in one arena, from those lifetimes;
3. :class:`ServingRun` — the capture that is kept: request *i* gets ``arena + offset[i]``.

Time counts requests: request *i* is live over ``[i, end)``, ``end`` being the number of requests made before
it was freed, or ``None`` if it was still live when the run ended (the step's outputs, a cache a kernel
keeps): nothing placed after such a request may overlap it. Sizes are rounded up to 256 bytes, the alignment
of every offset (cudaMalloc aligns to more, vector loads need 16 bytes).

Placement is greedy by size, best fit, as TFLite's and XLA's static planners do: requests largest first
(earlier first among equals), each into the smallest gap, between the requests already placed whose lifetimes
overlap its own, that holds it, else above them all.

Serving trusts the record only where it is checked: request *i* comes from the arena if its size is the
recorded one and its place overlaps no arena request still live past its recorded end (one the record said
was freed before request *i*, which this run holds longer). Anything else — a data-dependent request, a
different sequence — comes from the pool and is counted in ``fallbacks``. So no two live requests of the
arena ever overlap, whatever the run does.

Pure Python and NumPy: the device is a :class:`DeviceMemory` (CuPy's in the executor, a fake in the tests).
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

ALIGN = 256


def aligned(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` takes in the arena (a multiple of :data:`ALIGN`, at least one)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


@dataclass(frozen=True)
class Request:
    """One allocation of a run: its (aligned) size and the number of requests made before it was freed."""

    size: int
    end: int | None  # None: still live when the run ended


@dataclass(frozen=True)
class Placement:
    """Where each request of a run lies in the arena, and how big the arena is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ends: tuple[int, ...]  # a request live at the end of the run ends at len(sizes)
    nbytes: int  # the arena: the highest end of a placed request
    live_peak: int  # the most bytes live at once: no placement fits in less
    requested: int  # every request's bytes added up: what a run that reused nothing would take


def _ends(requests: Sequence[Request]) -> list[int]:
    n = len(requests)
    ends = [n if r.end is None else r.end for r in requests]
    for i, end in enumerate(ends):
        if not i < end <= n:
            raise ValueError(f"request {i}: end {requests[i].end} is not after its start and within the run "
                             f"of {n} requests")
    return ends


def live_peak(requests: Sequence[Request]) -> int:
    """The most bytes live at once: the bound that any placement of ``requests`` reaches at best."""
    n = len(requests)
    if not n:
        return 0
    delta = np.zeros(n + 1, np.int64)
    for i, (r, end) in enumerate(zip(requests, _ends(requests), strict=True)):
        delta[i] += r.size
        delta[end] -= r.size
    return int(np.cumsum(delta).max())


def place(requests: Sequence[Request]) -> Placement:
    """Offsets for ``requests`` in one arena: greedy by size, best fit (deterministic)."""
    n = len(requests)
    sizes = [r.size for r in requests]
    for i, s in enumerate(sizes):
        if s <= 0 or s % ALIGN:
            raise ValueError(f"request {i}: size {s} is not a positive multiple of {ALIGN}")
    ends = _ends(requests)
    offsets = [0] * n
    # the requests placed so far, as arrays, so that finding those alive beside a request is one vector step
    p_start = np.empty(n, np.int64)
    p_end = np.empty(n, np.int64)
    p_lo = np.empty(n, np.int64)
    p_hi = np.empty(n, np.int64)
    top = 0
    for m, i in enumerate(sorted(range(n), key=lambda i: (-sizes[i], i))):
        size = sizes[i]
        offset = 0
        if m:
            beside = (p_start[:m] < ends[i]) & (p_end[:m] > i)
            lo, hi = p_lo[:m][beside], p_hi[:m][beside]
            if lo.size:
                order = np.argsort(lo, kind="stable")
                lo, hi = lo[order], hi[order]
                reach = np.maximum.accumulate(hi)  # the top of everything at or below each request
                below = np.concatenate(([0], reach[:-1]))
                gaps = lo - below
                fits = np.flatnonzero(gaps >= size)
                offset = int(below[fits[np.argmin(gaps[fits])]]) if fits.size else int(reach[-1])
        offsets[i] = offset
        p_start[m], p_end[m], p_lo[m], p_hi[m] = i, ends[i], offset, offset + size
        top = max(top, offset + size)
    return Placement(tuple(offsets), tuple(sizes), tuple(ends), top, live_peak(requests), sum(sizes))


class DeviceMemory(Protocol):
    """The device under an allocation run."""

    def block(self, nbytes: int) -> tuple[int, object]:
        """Fresh memory of ``nbytes`` from a pool: its address, and the object that keeps it allocated."""
        ...

    def pointer(self, address: int, nbytes: int, owner: object) -> object:
        """What the allocator function returns (CuPy: a ``MemoryPointer``) for ``nbytes`` at ``address``,
        holding ``owner`` for as long as the memory is in use."""
        ...


class _Allocation:
    """The owner of one request's memory: the pointer keeps it alive, so its end is the request's free."""

    __slots__ = ("index", "keep", "run")

    def __init__(self, run: AllocationRun, index: int, keep: object) -> None:
        self.run = run
        self.index = index
        self.keep = keep  # the pool block, or the arena: released after the request

    # sys.is_finalizing bound as a default: at interpreter shutdown the module's globals may be gone
    def __del__(self, _is_finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        if not _is_finalizing():
            self.run.freed(self.index)


class AllocationRun:
    """One run of the launch list under this allocator function (``cupy.cuda.using_allocator(run)``): the
    size of each request and when it was freed, until :meth:`finish`."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.sizes: list[int] = []
        self.ends: list[int | None] = []
        self.finished = False

    def __call__(self, nbytes: int) -> object:
        raise NotImplementedError

    def _next(self, nbytes: int) -> tuple[int, int]:
        index = len(self.sizes)
        size = aligned(nbytes)
        self.sizes.append(size)
        self.ends.append(None)
        return index, size

    def _from_pool(self, index: int, nbytes: int) -> object:
        address, keep = self.memory.block(nbytes)
        return self.memory.pointer(address, nbytes, _Allocation(self, index, keep))

    def freed(self, index: int) -> None:
        """Request ``index`` was freed (called by its owner); after :meth:`finish` it counts as live at the end."""
        if not self.finished:
            self.ends[index] = len(self.sizes)

    def finish(self) -> None:
        """The run is over: what is freed from now on was live at its end."""
        self.finished = True

    def requests(self) -> list[Request]:
        return [Request(s, e) for s, e in zip(self.sizes, self.ends, strict=True)]


class RecordingRun(AllocationRun):
    """Every request from the pool, logged."""

    def __call__(self, nbytes: int) -> object:
        index, _ = self._next(nbytes)
        return self._from_pool(index, nbytes)


class ServingRun(AllocationRun):
    """Requests served at their planned offsets in the arena at ``base`` (kept alive by ``arena``) where that
    is safe, from the pool where it is not; logged like a recording, so a run that strayed can be planned."""

    def __init__(self, memory: DeviceMemory, placement: Placement, base: int, arena: object) -> None:
        super().__init__(memory)
        self.placement = placement
        self.base = base
        self.arena = arena
        self.fallbacks = 0  # requests the pool served
        self.first_fallback: str | None = None  # which request was the first, and why
        self._live: dict[int, tuple[int, int]] = {}  # arena requests not freed yet → their [lo, hi)
        self._due: list[tuple[int, int]] = []  # (recorded end, index) of live arena requests, soonest first
        self._overdue: dict[int, tuple[int, int]] = {}  # live arena requests past their recorded end

    def __call__(self, nbytes: int) -> object:
        index, size = self._next(nbytes)
        p = self.placement
        if index >= len(p.sizes):
            return self._fallback(index, nbytes, f"request {index} ({nbytes} bytes): the recorded run made "
                                                 f"{len(p.sizes)} requests")
        if p.sizes[index] != size:
            return self._fallback(index, nbytes, f"request {index}: {size} bytes, recorded {p.sizes[index]}")
        while self._due and self._due[0][0] <= index:
            _, j = heapq.heappop(self._due)
            if j in self._live:
                self._overdue[j] = self._live[j]
        lo = p.offsets[index]
        hi = lo + size
        for j, (jlo, jhi) in self._overdue.items():
            if lo < jhi and jlo < hi:
                return self._fallback(index, nbytes, f"request {index}: its place overlaps request {j}, which "
                                                     "the recorded run had freed by then")
        self._live[index] = (lo, hi)
        heapq.heappush(self._due, (p.ends[index], index))
        return self.memory.pointer(self.base + lo, nbytes, _Allocation(self, index, self.arena))

    def _fallback(self, index: int, nbytes: int, why: str) -> object:
        self.fallbacks += 1
        if self.first_fallback is None:
            self.first_fallback = why
        return self._from_pool(index, nbytes)

    def freed(self, index: int) -> None:
        super().freed(index)
        self._live.pop(index, None)
        self._overdue.pop(index, None)


@dataclass(frozen=True)
class ArenaReport:
    """The CUDA executor's memory: the planned arena against what the step asks for."""

    arena_bytes: int  # planned: the arena the captured graph runs in
    request_bytes: int  # unplanned: every allocation request of one step added up (nothing reused)
    live_peak_bytes: int  # the most bytes live at once: what no placement can beat
    pool_bytes: int  # what CuPy's memory pool held after the recording run (the executor without a plan)
    requests: int
    fallbacks: int  # requests of the kept capture that the pool served, not the arena


__all__ = ["ALIGN", "AllocationRun", "ArenaReport", "DeviceMemory", "Placement", "RecordingRun", "Request",
           "ServingRun", "aligned", "live_peak", "place"]
