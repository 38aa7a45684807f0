"""``blutrain_backend_cupy.cuda``: the "cuda" device's helper namespace (as ``torch.cuda``).

    from blutrain_backend_cupy import cuda
    if cuda.is_available():
        with cuda.stream() as s:
            ...                       # BluTrain's CUDA kernels go to s
        cuda.synchronize()
"""

from __future__ import annotations

from blutrain_backend_cupy.backend import CudaUnavailableError, backend, unavailable_error
from blutrain_backend_cupy.gemm import (
    fp32_gemm,
    gemm_sm_carveout,
    set_fp32_gemm,
    set_gemm_sm_carveout,
    set_tf32,
    tf32_enabled,
)
from blutrain_backend_cupy.memory import (
    CudaAllocatorError,
    allocator_name,
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    record_memory_history,
    reset_peak_memory_stats,
    save_memory_snapshot,
)
from blutrain_backend_cupy.streams import Event, Stream, current_stream, device, stream


def is_available() -> bool:
    """True when CuPy is installed and at least one NVIDIA GPU is visible."""
    return backend().is_available()


def device_count() -> int:
    return backend().device_count()


def synchronize(index: int | None = None) -> None:
    """Wait for all work queued on GPU ``index`` (every GPU when None)."""
    b = backend()
    if not b.is_available():
        raise unavailable_error()
    for i in range(b.device_count()) if index is None else (index,):
        b.synchronize(i)


def manual_seed(seed: int) -> None:
    """Seed the Philox generator of every GPU (the CPU generator is left alone)."""
    backend().manual_seed(seed)


__all__ = [
    "CudaAllocatorError",
    "CudaUnavailableError",
    "Event",
    "Stream",
    "allocator_name",
    "current_stream",
    "device",
    "device_count",
    "empty_cache",
    "fp32_gemm",
    "gemm_sm_carveout",
    "is_available",
    "manual_seed",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "record_memory_history",
    "reset_peak_memory_stats",
    "save_memory_snapshot",
    "set_fp32_gemm",
    "set_gemm_sm_carveout",
    "set_tf32",
    "stream",
    "synchronize",
    "tf32_enabled",
]
