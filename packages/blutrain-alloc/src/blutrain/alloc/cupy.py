"""CuPy hook-up: CUDA device and pinned-host providers, and ``install()`` to make CuPy allocate through
blutrain's caching allocator.

CuPy is imported when first needed, so importing this module needs neither CuPy nor a GPU; using it
without CuPy raises ``CupyUnavailableError``.

CuPy calls the installed allocator with a byte count and gets a ``cupy.cuda.MemoryPointer`` over an
``UnownedMemory`` whose owner frees the block when CuPy drops the memory. The block is allocated on the
current stream and, once freed, is reused in that stream's order; an array used on another stream must
be announced with ``CupyAllocator.record_stream`` (as with PyTorch's ``Tensor.record_stream``).

With expandable segments (``install(expandable_segments=True)``, or ``BLUTRAIN_ALLOC_CONF=
"expandable_segments:True"`` read by ``install()``), device memory comes from CUDA virtual memory instead
of cudaMalloc: ``CupyDeviceProvider`` reserves ranges and maps 2 MiB chunks through the driver API
(``blutrain.alloc.cuda_driver``). Such memory is accessible from its own device only.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from blutrain.alloc.allocator import CachingAllocator
from blutrain.alloc.cuda_driver import DeviceVirtualMemory
from blutrain.alloc.errors import AllocatorError, CupyUnavailableError

__all__ = [
    "CONF_VARIABLE",
    "CupyAllocator",
    "CupyDeviceProvider",
    "CupyPinnedAllocator",
    "CupyPinnedProvider",
    "conf_from_env",
    "install",
    "install_pinned",
    "uninstall",
    "uninstall_pinned",
]

# cudaErrorMemoryAllocation, should the installed CuPy not export the constant.
_CUDA_ERROR_MEMORY_ALLOCATION = 2
CONF_VARIABLE = "BLUTRAIN_ALLOC_CONF"


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise CupyUnavailableError(
            f"blutrain.alloc.cupy needs CuPy, which could not be imported ({exc}); install it with"
            " pip install 'blutrain-alloc[cuda12]' (CUDA 12) or 'blutrain-alloc[cuda13]' (CUDA 13)"
        ) from exc
    return cupy


def _is_out_of_memory(cupy: Any, error: BaseException) -> bool:
    runtime = cupy.cuda.runtime
    status = getattr(runtime, "errorMemoryAllocation", _CUDA_ERROR_MEMORY_ALLOCATION)
    return isinstance(error, runtime.CUDARuntimeError) and error.status == status


class _CudaEvents:
    """Stream events as CUDA events, recorded on the provider's device."""

    _cupy: Any
    device_id: int

    def record_event(self, stream: int) -> Any:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            event = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, stream)
        return event

    def query_event(self, event: Any) -> bool:
        return bool(event.done)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def release_event(self, event: Any) -> None:
        """Nothing to do: the cupy.cuda.Event destroys its CUDA event when it is collected."""


class CupyDeviceProvider(_CudaEvents):
    """Device memory of one GPU through cudaMalloc/cudaFree (``cupy.cuda.runtime``), and expandable memory
    (``reserve``/``map``/``unmap``/``release``/``granularity``) through the CUDA driver's virtual memory
    management, loaded on first use."""

    _virtual: DeviceVirtualMemory | None = None

    def __init__(self, device_id: int | None = None) -> None:
        cupy = _import_cupy()
        self._cupy = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if device_id is None:
            device_id = cupy.cuda.runtime.getDevice()
        if not 0 <= device_id < count:
            raise ValueError(
                f"CupyDeviceProvider(device_id): expected 0 <= device_id < {count}, got {device_id}"
            )
        self.device_id = device_id

    def alloc(self, size: int) -> int:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            try:
                return int(cupy.cuda.runtime.malloc(size))
            except Exception as exc:
                if _is_out_of_memory(cupy, exc):
                    return 0
                raise

    def free(self, ptr: int) -> None:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.free(ptr)

    def mem_info(self) -> tuple[int, int] | None:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            free, total = cupy.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def _virtual_memory(self) -> DeviceVirtualMemory:
        """The driver-API side, made on first use with the device current."""
        if self._virtual is None:
            self._cupy.cuda.runtime.free(0)  # makes sure the device's primary context exists
            self._virtual = DeviceVirtualMemory(self.device_id)
        return self._virtual

    def granularity(self) -> int:
        with self._cupy.cuda.Device(self.device_id):
            return self._virtual_memory().granularity

    def reserve(self, size: int) -> int:
        with self._cupy.cuda.Device(self.device_id):
            return self._virtual_memory().reserve(size)

    def map(self, address: int, size: int) -> bool:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            # More than the device has free would fail only after creating chunks up to that point.
            if size > cupy.cuda.runtime.memGetInfo()[0]:
                return False
            return self._virtual_memory().map(address, size)

    def unmap(self, address: int, size: int) -> None:
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            # Unlike cudaFree, cuMemUnmap does not wait for queued work that still uses the memory.
            cupy.cuda.runtime.deviceSynchronize()
            self._virtual_memory().unmap(address, size)

    def release(self, base: int, size: int) -> None:
        with self._cupy.cuda.Device(self.device_id):
            self._virtual_memory().release(base, size)


class CupyPinnedProvider(_CudaEvents):
    """Page-locked host memory through cudaHostAlloc/cudaFreeHost, usable by every device (portable).
    Events are recorded on ``device_id`` (the current device when created)."""

    def __init__(self, device_id: int | None = None) -> None:
        cupy = _import_cupy()
        self._cupy = cupy
        self.device_id = cupy.cuda.runtime.getDevice() if device_id is None else device_id

    def alloc(self, size: int) -> int:
        cupy = self._cupy
        try:
            return int(cupy.cuda.runtime.hostAlloc(size, cupy.cuda.runtime.hostAllocPortable))
        except Exception as exc:
            if _is_out_of_memory(cupy, exc):
                return 0
            raise

    def free(self, ptr: int) -> None:
        self._cupy.cuda.runtime.freeHost(ptr)

    def mem_info(self) -> tuple[int, int] | None:
        return None


class _DeviceBlock:
    """The owner CuPy's UnownedMemory keeps alive: when CuPy drops the memory, the block is freed."""

    __slots__ = ("_allocator", "_ptr")

    def __init__(self, allocator: CachingAllocator, ptr: int) -> None:
        self._allocator = allocator
        self._ptr = ptr

    # sys.is_finalizing bound as a default: a block dropped during interpreter shutdown finds the
    # module's globals already cleared to None.
    def __del__(self, _is_finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        if not _is_finalizing():
            self._allocator.free(self._ptr)


class CupyAllocator:
    """CuPy's allocator function backed by one CachingAllocator per device (made on first use).

    ``cupy.cuda.set_allocator(CupyAllocator())`` is what ``install()`` does.
    """

    def __init__(
        self, *, expandable_segments: bool = False, record_stacks: bool = False, trace_capacity: int = 0
    ) -> None:
        cupy = _import_cupy()
        self._cupy = cupy
        self.expandable_segments = expandable_segments
        self._record_stacks = record_stacks
        self._trace_capacity = trace_capacity
        self._allocators: dict[int, CachingAllocator] = {}
        self._lock = threading.Lock()
        # Bound once: __call__ runs for every CuPy array, and attribute chains cost host time there.
        self._get_device = cupy.cuda.runtime.getDevice
        self._stream_ptr = getattr(cupy.cuda.stream, "get_current_stream_ptr", None) or (
            lambda: cupy.cuda.get_current_stream().ptr
        )
        self._unowned_memory = cupy.cuda.memory.UnownedMemory
        self._memory_pointer = cupy.cuda.MemoryPointer

    def allocator(self, device_id: int | None = None) -> CachingAllocator:
        """The CachingAllocator of ``device_id`` (default: the current device)."""
        if device_id is None:
            device_id = int(self._cupy.cuda.runtime.getDevice())
        allocator = self._allocators.get(device_id)
        if allocator is None:
            with self._lock:
                allocator = self._allocators.get(device_id)
                if allocator is None:
                    allocator = CachingAllocator(
                        CupyDeviceProvider(device_id),
                        expandable_segments=self.expandable_segments,
                        record_stacks=self._record_stacks,
                        trace_capacity=self._trace_capacity,
                    )
                    self._allocators[device_id] = allocator
        return allocator

    def __call__(self, size: int) -> Any:
        device_id = self._get_device()
        if size == 0:  # as CuPy's own pool does: a null pointer that owns nothing
            return self._memory_pointer(self._unowned_memory(0, 0, None, device_id), 0)
        allocator = self._allocators.get(device_id) or self.allocator(device_id)
        ptr = allocator.malloc(size, self._stream_ptr())
        memory = self._unowned_memory(ptr, size, _DeviceBlock(allocator, ptr), device_id)
        return self._memory_pointer(memory, 0)

    def record_stream(self, memory: Any, stream: Any) -> None:
        """Marks the block under ``memory`` (a cupy.ndarray or MemoryPointer from this allocator) as used on
        ``stream`` (a cupy.cuda.Stream or its handle): it is reused only after that stream's work so far."""
        pointer = memory.data if hasattr(memory, "data") else memory
        stream_ptr = stream if isinstance(stream, int) else stream.ptr
        self.allocator(int(pointer.device_id)).record_stream(int(pointer.mem.ptr), stream_ptr)

    def empty_cache(self) -> None:
        """Returns every wholly free segment of every device to CUDA."""
        for allocator in list(self._allocators.values()):
            allocator.empty_cache()


class _PinnedBlock:
    """What CuPy's PinnedMemoryPointer holds as ``mem`` (``ptr`` and ``size``); dropping it frees the block.
    CuPy keeps it alive until asynchronous copies that use it have finished."""

    __slots__ = ("_allocator", "ptr", "size")

    def __init__(self, allocator: CachingAllocator | None, ptr: int, size: int) -> None:
        self._allocator = allocator
        self.ptr = ptr
        self.size = size

    def __int__(self) -> int:
        return self.ptr

    def __del__(self, _is_finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        if self._allocator is not None and not _is_finalizing():
            self._allocator.free(self.ptr)


class CupyPinnedAllocator:
    """CuPy's pinned-memory allocator function backed by a CachingAllocator over CupyPinnedProvider."""

    def __init__(self, *, record_stacks: bool = False, trace_capacity: int = 0) -> None:
        self._cupy = _import_cupy()
        self.allocator = CachingAllocator(
            CupyPinnedProvider(), record_stacks=record_stacks, trace_capacity=trace_capacity
        )

    def __call__(self, size: int) -> Any:
        pinned = self._cupy.cuda.PinnedMemoryPointer
        if size == 0:
            return pinned(_PinnedBlock(None, 0, 0), 0)
        ptr = self.allocator.malloc(size, 0)
        return pinned(_PinnedBlock(self.allocator, ptr, size), 0)


_state_lock = threading.Lock()
_previous_allocator: Any = None
_installed: CupyAllocator | None = None


def conf_from_env() -> dict[str, bool]:
    """The options of ``BLUTRAIN_ALLOC_CONF`` (``"expandable_segments:True"``; comma-separated
    ``name:value`` pairs, as PyTorch's ``PYTORCH_CUDA_ALLOC_CONF``); an unknown name or value raises
    AllocatorError."""
    options: dict[str, bool] = {}
    text = os.environ.get(CONF_VARIABLE, "")
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = (piece.strip() for piece in item.partition(":"))
        if name != "expandable_segments":
            raise AllocatorError(f"{CONF_VARIABLE}: expected the option expandable_segments, got {name!r} in {text!r}")
        if value.lower() not in ("true", "false"):
            raise AllocatorError(f"{CONF_VARIABLE}: expected expandable_segments:True or :False, got {item!r}")
        options[name] = value.lower() == "true"
    return options


def install(
    *, expandable_segments: bool | None = None, record_stacks: bool = False, trace_capacity: int = 0
) -> CupyAllocator:
    """Makes CuPy allocate device memory through a new CupyAllocator and returns it.

    ``expandable_segments=None`` takes the setting from ``BLUTRAIN_ALLOC_CONF`` (off when unset).
    Arrays allocated before keep their memory and free it to the allocator they came from.
    """
    global _previous_allocator, _installed
    cupy = _import_cupy()
    if expandable_segments is None:
        expandable_segments = conf_from_env().get("expandable_segments", False)
    allocator = CupyAllocator(
        expandable_segments=expandable_segments, record_stacks=record_stacks, trace_capacity=trace_capacity
    )
    with _state_lock:
        if _installed is None:
            _previous_allocator = cupy.cuda.memory.get_allocator()
        cupy.cuda.set_allocator(allocator)
        _installed = allocator
    return allocator


def uninstall() -> None:
    """Gives CuPy back the allocator it had before ``install()``; a no-op if none is installed."""
    global _previous_allocator, _installed
    cupy = _import_cupy()
    with _state_lock:
        if _installed is None:
            return
        cupy.cuda.set_allocator(_previous_allocator)
        _previous_allocator = None
        _installed = None


def install_pinned(*, record_stacks: bool = False, trace_capacity: int = 0) -> CupyPinnedAllocator:
    """Makes CuPy allocate pinned host memory through a new CupyPinnedAllocator and returns it."""
    cupy = _import_cupy()
    allocator = CupyPinnedAllocator(record_stacks=record_stacks, trace_capacity=trace_capacity)
    cupy.cuda.set_pinned_memory_allocator(allocator)
    return allocator


def uninstall_pinned() -> None:
    """Gives CuPy a fresh default pinned-memory pool (CuPy has no getter for the one it had)."""
    cupy = _import_cupy()
    cupy.cuda.set_pinned_memory_allocator(cupy.cuda.PinnedMemoryPool().malloc)
