"""CUDA virtual memory management through the driver API (libcuda.so.1 by ctypes), for expandable segments.

CuPy's ``cupy.cuda.driver`` lacks most of these calls, so they are bound here, on first use: importing this
module loads nothing. ``DeviceVirtualMemory`` is what ``CupyDeviceProvider``'s expandable-memory methods
call: ranges reserved with cuMemAddressReserve, each mapped chunk its own physical allocation
(cuMemCreate, pinned on the device) mapped with cuMemMap and made readable and writable with
cuMemSetAccess, so that any chunk can be unmapped (cuMemUnmap, cuMemRelease) on its own.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from blutrain.alloc.errors import AllocatorError

__all__ = ["DeviceVirtualMemory"]

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _MemAllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _MemAccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_u64 = ctypes.c_uint64
_size = ctypes.c_size_t
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_MemAllocationProp), ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_MemAllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [_u64],
    "cuMemMap": [_u64, _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_MemAccessDesc), _size],
}

_driver_lock = threading.Lock()
_driver: dict[str, Callable[..., int]] | None = None


def _load_driver() -> dict[str, Callable[..., int]]:
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                library = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise AllocatorError(
                    f"expandable segments need the CUDA driver library libcuda.so.1, which could not be loaded ({exc})"
                ) from exc
            functions: dict[str, Callable[..., int]] = {}
            for name, argtypes in _SIGNATURES.items():
                function = getattr(library, name)
                function.argtypes = argtypes
                function.restype = ctypes.c_int
                functions[name] = function
            _check(functions, "cuInit", functions["cuInit"](0))
            _driver = functions
        return _driver


def _check(driver: dict[str, Callable[..., int]], call: str, status: int) -> None:
    if status != _CUDA_SUCCESS:
        name = ctypes.c_char_p()
        driver["cuGetErrorName"](status, ctypes.byref(name))
        text = name.value.decode() if name.value else "an unknown error"
        raise AllocatorError(f"{call} failed with {text} ({status})")


class DeviceVirtualMemory:
    """Reserved ranges and mapped chunks of device memory on one GPU, with a handle table per chunk.
    The caller makes the device current; every size and address is a multiple of ``granularity``."""

    def __init__(self, device_id: int) -> None:
        self._driver = _load_driver()
        self.device_id = device_id
        self._prop = _MemAllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device_id)
        self._access = _MemAccessDesc(
            _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device_id), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        granularity = _size()
        self._call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(granularity),
            ctypes.byref(self._prop),
            _CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        self.granularity = int(granularity.value)
        self._handles: dict[int, int] = {}  # chunk address -> its physical allocation
        self._reserved: dict[int, int] = {}  # base -> size

    def _call(self, name: str, *args: Any) -> int:
        status = self._driver[name](*args)
        _check(self._driver, name, status)
        return status

    def reserve(self, size: int) -> int:
        base = _u64()
        if self._driver["cuMemAddressReserve"](ctypes.byref(base), size, self.granularity, 0, 0) != _CUDA_SUCCESS:
            return 0
        self._reserved[int(base.value)] = size
        return int(base.value)

    def map(self, address: int, size: int) -> bool:
        done: list[int] = []  # chunks mapped by this call, undone if it cannot finish
        try:
            for chunk in range(address, address + size, self.granularity):
                if chunk in self._handles:
                    raise AllocatorError(f"map(address, size): the chunk at {chunk:#x} is already mapped")
                handle = _u64()
                prop = ctypes.byref(self._prop)
                status = self._driver["cuMemCreate"](ctypes.byref(handle), self.granularity, prop, 0)
                if status == _CUDA_ERROR_OUT_OF_MEMORY:
                    break
                _check(self._driver, "cuMemCreate", status)
                status = self._driver["cuMemMap"](chunk, self.granularity, 0, handle, 0)
                if status != _CUDA_SUCCESS:
                    self._driver["cuMemRelease"](handle)
                    _check(self._driver, "cuMemMap", status)
                self._handles[chunk] = int(handle.value)
                done.append(chunk)
            else:
                self._call("cuMemSetAccess", address, size, ctypes.byref(self._access), 1)
                return True
        except BaseException:
            self._unmap_chunks(done)
            raise
        self._unmap_chunks(done)
        return False

    def unmap(self, address: int, size: int) -> None:
        chunks = list(range(address, address + size, self.granularity))
        missing = [chunk for chunk in chunks if chunk not in self._handles]
        if missing:
            raise AllocatorError(f"unmap(address, size): the chunk at {missing[0]:#x} is not mapped")
        self._unmap_chunks(chunks)

    def _unmap_chunks(self, chunks: list[int]) -> None:
        first_error: BaseException | None = None
        for chunk in chunks:
            handle = self._handles.pop(chunk)
            for name, args in (("cuMemUnmap", (chunk, self.granularity)), ("cuMemRelease", (handle,))):
                try:
                    self._call(name, *args)
                except AllocatorError as exc:
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def release(self, base: int, size: int) -> None:
        if self._reserved.get(base) != size:
            raise AllocatorError(
                f"release(base, size): expected a range returned by reserve() and not yet released, got {base:#x}"
                f" and {size}"
            )
        del self._reserved[base]
        self._call("cuMemAddressFree", base, size)

    @property
    def mapped_bytes(self) -> int:
        return len(self._handles) * self.granularity
