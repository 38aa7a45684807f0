"""``CupyBackend.write_from_host`` on a GPU: the copy is queued on the current stream after the kernels already there
(which read the old values), the call returns while they still run, the host buffer may be reused at once, staging
slots are reused only after their copy ran, and a write during a graph capture is refused. Skipped without a GPU."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from blutrain.tensor import TensorTypeError
from blutrain.tensor.backend import get_backend
from blutrain_backend_cupy import CaptureWriteError, Event, Stream, cuda, stream
from blutrain_backend_cupy.host_writes import PinnedStaging

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda.is_available(), reason="needs an NVIDIA GPU and CuPy")]

# Thread 0 spins until the host sets ``flag`` (page-locked, mapped: the GPU reads the host's store), then every
# thread copies ``src`` to ``dst``. ``limit`` cycles (several seconds) end the wait in any case and set ``timed_out``:
# a write that waited for this kernel would have returned only after that.
_WAIT_THEN_COPY = r"""
extern "C" __global__ void wait_then_copy(const volatile int* flag, const double* src, double* dst, int n,
                                          long long limit, int* timed_out) {
    if (threadIdx.x == 0) {
        long long start = clock64();
        while (*flag == 0) {
            if (clock64() - start > limit) {
                *timed_out = 1;
                break;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""
# Busy for ``cycles`` clock cycles: work queued behind it waits.
_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""
WAIT_LIMIT_CYCLES = 20_000_000_000  # about 10 s at 2 GHz
SPIN_CYCLES = 400_000_000  # about 0.2 s at 2 GHz


def _cupy() -> Any:
    import cupy

    return cupy


class HostFlag:
    """One int32 in page-locked host memory mapped into the GPU's address space (the same pointer under UVA)."""

    def __init__(self) -> None:
        cp = _cupy()
        self.ptr = int(cp.cuda.runtime.hostAlloc(4, cp.cuda.runtime.hostAllocMapped))
        self.value = (ctypes.c_int32 * 1).from_address(self.ptr)
        self.value[0] = 0

    def set(self) -> None:
        self.value[0] = 1


@contextmanager
def host_flag() -> Iterator[HostFlag]:
    cp = _cupy()
    flag = HostFlag()
    try:
        yield flag
    finally:
        flag.set()  # a kernel still waiting on it ends before the memory goes
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.freeHost(flag.ptr)


def test_a_write_is_ordered_after_earlier_kernels_and_returns_while_they_run() -> None:
    cp = _cupy()
    backend = get_backend("cuda")
    kernel = cp.RawKernel(_WAIT_THEN_COPY, "wait_then_copy")
    old, new = np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0])
    s = Stream()  # not the default stream
    with stream(s):
        x = backend.from_host(old, 0)
        backend.write_from_host(x, old)  # a staging slot exists before the kernel below is queued
        out, timed_out = cp.zeros(3), cp.zeros(1, dtype=cp.int32)
        s.synchronize()
        with host_flag() as flag:
            kernel((1,), (32,), (np.uint64(flag.ptr), x, out, np.int32(3), np.int64(WAIT_LIMIT_CYCLES), timed_out))
            kernel_done = s.record_event(Event(enable_timing=False))
            host = new.copy()
            backend.write_from_host(x, host)
            host[...] = -1.0  # the host buffer is reused at once
            returned_while_the_kernel_ran = not kernel_done.query()
            flag.set()
            s.synchronize()
    assert returned_while_the_kernel_ran, "write_from_host waited for the kernel queued before it"
    assert int(timed_out.get()[0]) == 0
    assert out.get().tolist() == old.tolist()  # the kernel queued before the write read the old values
    assert x.get().tolist() == new.tolist()  # the write's values, not the host buffer's later ones


def test_staging_slots_are_reused_only_after_their_copy_ran() -> None:
    cp = _cupy()
    spin = cp.RawKernel(_SPIN, "spin")
    staging = PinnedStaging(cp, 0, max_slots=2)
    s = Stream()
    with stream(s):
        arrays = [cp.zeros(4) for _ in range(6)]
        s.synchronize()
        spin((1,), (1,), (np.int64(SPIN_CYCLES),))  # the copies below queue behind it
        for i, a in enumerate(arrays):
            host = np.full(4, float(i + 1))
            staging.write(a, host)
            host[...] = -1.0
        s.synchronize()
    assert staging.slots == 2
    assert [a.get().tolist() for a in arrays] == [[float(i + 1)] * 4 for i in range(6)]


def test_a_write_while_the_stream_captures_a_graph_is_refused() -> None:
    cp = _cupy()
    backend = get_backend("cuda")
    s = Stream()
    with stream(s):
        x = backend.from_host(np.zeros(3), 0)
        s.synchronize()
        s.raw.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            with pytest.raises(CaptureWriteError, match=r"write_from_host: the current stream of cuda:0 is "
                                                        r"capturing a CUDA graph"):
                backend.write_from_host(x, np.ones(3))
        finally:
            s.raw.end_capture()
        s.synchronize()
    assert x.get().tolist() == [0.0, 0.0, 0.0]


def test_an_empty_write_queues_nothing_and_a_host_array_as_target_is_refused() -> None:
    backend = get_backend("cuda")
    empty = backend.from_host(np.zeros((0, 3)), 0)
    backend.write_from_host(empty, np.zeros((0, 3)))
    with pytest.raises(TensorTypeError, match=r"write_from_host: array must be a cupy.ndarray, got ndarray"):
        backend.write_from_host(np.zeros(3), np.ones(3))
