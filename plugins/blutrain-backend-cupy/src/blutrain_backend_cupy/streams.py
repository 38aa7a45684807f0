"""CUDA streams and events for the "cuda" device, thin and typed over CuPy's.

Every kernel BluTrain launches on the GPU goes to CuPy's current stream, so ``with stream(s):``
is all it takes to move work onto ``s``; an :class:`Event` orders work between streams and times it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from blutrain_backend_cupy.backend import require_cupy


class Stream:
    """A CUDA stream on one device. ``non_blocking`` streams do not synchronize with the legacy
    default stream; lower ``priority`` numbers run first."""

    def __init__(self, device: int | None = None, *, non_blocking: bool = True, priority: int | None = None,
                 raw: Any = None) -> None:
        cp = require_cupy()
        self.device = cp.cuda.Device().id if device is None else int(device)
        if raw is None:
            with cp.cuda.Device(self.device):
                raw = cp.cuda.Stream(non_blocking=non_blocking, priority=priority)
        self.raw = raw

    @property
    def ptr(self) -> int:
        return int(self.raw.ptr)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        """True when every piece of work queued on the stream has finished."""
        return bool(self.raw.done)

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits until ``event`` has completed (no host blocking)."""
        self.raw.wait_event(event.raw)

    def wait_stream(self, other: Stream) -> None:
        """Later work on this stream waits for everything queued on ``other`` so far."""
        ev = Event(enable_timing=False)
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, event: Event | None = None) -> Event:
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def __repr__(self) -> str:
        return f"blutrain_backend_cupy.Stream(device={self.device}, ptr={self.ptr:#x})"


class Event:
    """A CUDA event: a point in a stream's work to wait for or to time against."""

    def __init__(self, *, enable_timing: bool = True, blocking: bool = False) -> None:
        cp = require_cupy()
        self.raw = cp.cuda.Event(block=blocking, disable_timing=not enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        """Mark the current point of ``stream`` (default: the current stream)."""
        self.raw.record(None if stream is None else stream.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.done)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded, with timing enabled)."""
        cp = require_cupy()
        return float(cp.cuda.get_elapsed_time(self.raw, end.raw))


def current_stream(device: int | None = None) -> Stream:
    """The stream BluTrain's CUDA kernels are queued on now (on ``device``, default the current one)."""
    cp = require_cupy()
    if device is None:
        return Stream(raw=cp.cuda.get_current_stream())
    with cp.cuda.Device(device):
        return Stream(device, raw=cp.cuda.get_current_stream())


@contextmanager
def stream(s: Stream | None = None, device: int | None = None) -> Iterator[Stream]:
    """Make ``s`` (a new non-blocking stream if None) current for the block, on its device."""
    cp = require_cupy()
    if s is None:
        s = Stream(device)
    with cp.cuda.Device(s.device), s.raw:
        yield s


@contextmanager
def device(index: int) -> Iterator[None]:
    """Make GPU ``index`` current for the block: factories and kernels allocate there."""
    cp = require_cupy()
    with cp.cuda.Device(index):
        yield
