"""GPU memory of the "cuda" device: which allocator CuPy uses, and its numbers (as ``torch.cuda``'s).

By default the backend makes CuPy allocate through blutrain-alloc's caching allocator
(``blutrain.alloc.cupy.install()``) when it first finds a GPU, so that peaks, fragmentation, snapshots
and the out-of-memory report are there for every run. ``BLUTRAIN_CUDA_ALLOCATOR=cupy`` keeps CuPy's own
memory pool instead (then only the current allocated and reserved bytes can be read).
"""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blutrain.tensor.errors import BluTrainError

if TYPE_CHECKING:  # blutrain.alloc is imported when the allocator is installed, not when the plugin loads
    from blutrain.alloc import AllocatorStats, CachingAllocator, SegmentSnapshot
    from blutrain.alloc.cupy import CupyAllocator

ALLOCATOR_ENV = "BLUTRAIN_CUDA_ALLOCATOR"
ALLOCATORS = ("blutrain", "cupy")


class CudaAllocatorError(BluTrainError, RuntimeError):
    """A memory statistic was asked of an allocator that does not keep it, or the setting is wrong."""


_hook: CupyAllocator | None = None
_chosen: str | None = None


def allocator_name() -> str:
    """The allocator the environment asks for: "blutrain" (default) or "cupy"."""
    name = os.environ.get(ALLOCATOR_ENV, "blutrain").strip().lower() or "blutrain"
    if name not in ALLOCATORS:
        raise CudaAllocatorError(
            f"{ALLOCATOR_ENV}: expected one of {', '.join(ALLOCATORS)}, got {os.environ[ALLOCATOR_ENV]!r}"
        )
    return name


def install_default() -> str:
    """Called by the backend when it finds a GPU: installs the allocator the environment names, once."""
    global _hook, _chosen
    if _chosen is None:
        _chosen = allocator_name()
        if _chosen == "blutrain":
            from blutrain.alloc import cupy as alloc_cupy

            _hook = alloc_cupy.install()
    return _chosen


def _allocator(device: int | None) -> CachingAllocator:
    if _hook is None:
        raise CudaAllocatorError(
            f"this statistic needs BluTrain's caching allocator, but CuPy's pool is in use ({ALLOCATOR_ENV}="
            f"{_chosen or allocator_name()}); unset {ALLOCATOR_ENV} or set it to 'blutrain'"
        )
    return _hook.allocator(device)


def _cupy_pool() -> Any:
    import cupy

    return cupy.get_default_memory_pool()


def memory_stats(device: int | None = None) -> AllocatorStats:
    """Every counter of the GPU's caching allocator (current device when None)."""
    return _allocator(device).stats()


def memory_allocated(device: int | None = None) -> int:
    """Bytes in live blocks now."""
    if _hook is None:
        return int(_cupy_pool().used_bytes())
    return _allocator(device).stats().allocated_bytes


def memory_reserved(device: int | None = None) -> int:
    """Bytes taken from CUDA (live and cached) now."""
    if _hook is None:
        return int(_cupy_pool().total_bytes())
    return _allocator(device).stats().reserved_bytes


def max_memory_allocated(device: int | None = None) -> int:
    """Peak of ``memory_allocated`` since start or ``reset_peak_memory_stats``."""
    return _allocator(device).stats().allocated_bytes_peak


def max_memory_reserved(device: int | None = None) -> int:
    """Peak of ``memory_reserved`` since start or ``reset_peak_memory_stats``."""
    return _allocator(device).stats().reserved_bytes_peak


def reset_peak_memory_stats(device: int | None = None) -> None:
    _allocator(device).reset_peak()


def empty_cache() -> None:
    """Returns every wholly free cached segment to CUDA (whichever allocator is in use)."""
    if _hook is None:
        _cupy_pool().free_all_blocks()
    else:
        _hook.empty_cache()


def record_memory_history(enabled: bool = True, *, trace_capacity: int = 100_000, stacks: bool = True,
                          device: int | None = None) -> None:
    """Start (or stop) keeping allocator events for ``memory_snapshot``/``save_memory_snapshot``: the last
    ``trace_capacity`` events, and the Python stack of each allocation when ``stacks``."""
    allocator = _allocator(device)
    allocator.trace_capacity = trace_capacity if enabled else 0
    allocator.record_stacks = bool(enabled and stacks)


def memory_snapshot(include_stacks: bool = False, device: int | None = None) -> list[SegmentSnapshot]:
    """The allocator's segments and blocks now (see ``blutrain.alloc.SegmentSnapshot``)."""
    return _allocator(device).memory_snapshot(include_stacks)


def save_memory_snapshot(path: str | PathLike[str], device: int | None = None) -> Path:
    """Writes segments (with stacks where recorded), the event trace and the statistics to ``path`` as JSON;
    ``blutrain memory-plot PATH`` draws it."""
    from blutrain.alloc import save_snapshot

    allocator = _allocator(device)
    return save_snapshot(path, allocator.memory_snapshot(True), allocator.trace(), allocator.stats())


__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_ENV",
    "CudaAllocatorError",
    "allocator_name",
    "empty_cache",
    "install_default",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "record_memory_history",
    "reset_peak_memory_stats",
    "save_memory_snapshot",
]
