"""Host and device time per call for tools/bench_dispatch.py.

Host µs: the wall time of issuing ``calls`` calls back to back, divided by ``calls``, the median over batches.
The device is synchronised before and after each batch, outside the timed window, so a batch starts on an
empty queue and never inherits the previous batch's device work. Within a batch nothing synchronises: on cuda
the host time is what issuing the calls costs as long as the device keeps up (small shapes: a kernel there
takes less than its launch's host time) and the launch queue does not fill (a batch stays well under its
~1,000 pending launches; ``--calls-gpt2`` keeps the large shapes' batches short for that reason). On the CPU
the op runs where it is issued, so host time includes the (small) arithmetic.

Device µs (cuda only): the stream is first held by a spin kernel long enough for the host to issue
``calls`` calls behind it; CUDA events recorded after the spin and after the last call then time the calls'
device work alone, with no host gap between kernels.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    max_us: float


def host_time(call: Callable[[], Any], calls: int, batches: int, warmup: int,
              synchronize: Callable[[], None]) -> Timing:
    """µs per call of issuing ``calls`` calls back to back (median, min and max over ``batches`` batches)."""
    for _ in range(warmup):
        call()
    synchronize()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        synchronize()
    return Timing(statistics.median(per_call), min(per_call), max(per_call))


class DeviceClock(Protocol):
    """CUDA events and a spin kernel on the stream a framework launches to."""

    def spin(self, cycles: int) -> None:
        """Queue a kernel that keeps the stream busy for ``cycles`` GPU clock cycles."""
        ...

    def event(self) -> Any:
        """Record an event on the stream and return it."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded events; waits for ``end``."""
        ...


_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


class CupyClock:
    """Events and spin on CuPy's current stream, where BluTrain's cuda backend launches every kernel."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self._spin = cupy.RawKernel(_SPIN_SOURCE, "spin")

    def spin(self, cycles: int) -> None:
        self._spin((1,), (1,), (self._cp.int64(cycles),))

    def event(self) -> Any:
        ev = self._cp.cuda.Event()
        ev.record()
        return ev

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(self._cp.cuda.get_elapsed_time(start, end))


class TorchClock:
    """Events and ``torch.cuda._sleep`` on PyTorch's current stream."""

    def __init__(self) -> None:
        self._torch = importlib.import_module("torch")  # optional: not a dependency of the workspace

    def spin(self, cycles: int) -> None:
        self._torch.cuda._sleep(cycles)

    def event(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end))


class DeviceTimer:
    """Device µs per call: the calls queued behind a spin kernel, timed by the events around them."""

    CALIBRATION_CYCLES = 20_000_000

    def __init__(self, clock: DeviceClock, synchronize: Callable[[], None]) -> None:
        self.clock = clock
        self.synchronize = synchronize
        synchronize()
        clock.spin(1000)  # compiles / loads the spin kernel outside the calibration
        start = clock.event()
        clock.spin(self.CALIBRATION_CYCLES)
        ms = clock.elapsed_ms(start, clock.event())
        self.cycles_per_ms = self.CALIBRATION_CYCLES / max(ms, 1e-3)

    def time(self, call: Callable[[], Any], calls: int, host_us: float, repeats: int = 3) -> float:
        """Median over ``repeats`` of the device µs per call; ``host_us`` sizes the spin that hides the host."""
        hold_ms = 2.0 * calls * host_us / 1e3 + 2.0
        per_call = []
        for _ in range(repeats):
            self.synchronize()
            self.clock.spin(int(hold_ms * self.cycles_per_ms))
            start = self.clock.event()
            for _ in range(calls):
                call()
            end = self.clock.event()
            per_call.append(self.clock.elapsed_ms(start, end) * 1e3 / calls)
        return statistics.median(per_call)
