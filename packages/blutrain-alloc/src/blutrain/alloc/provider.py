"""The provider contract: where a CachingAllocator gets raw memory and stream events.

Native providers (called from C++ with no Python in between):

- ``HostProvider(limit=None)``: host memory (512-byte aligned) with an optional byte limit, and a fake
  stream clock: work on a stream finishes only when ``complete(stream)`` or ``synchronize_event`` says so.
- ``FunctionProvider(alloc_address, free_address)``: C functions ``void* alloc(size_t)`` and
  ``void free(void*)`` given by address; it has no events, so blocks stay on their own stream.

Any Python object with the methods of ``Provider`` works too (``blutrain.alloc.cupy`` has the CUDA ones).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from blutrain.alloc._core import FunctionProvider, HostProvider, NativeProvider

__all__ = ["FunctionProvider", "HostProvider", "NativeProvider", "Provider"]


@runtime_checkable
class Provider(Protocol):
    """What a CachingAllocator needs from a memory source. Streams are integers (a CUDA stream's handle,
    0 for the default stream); events are whatever the provider returns from ``record_event``."""

    def alloc(self, size: int) -> int:
        """A new region of ``size`` bytes, or 0 when the memory is exhausted (other failures raise)."""
        ...

    def free(self, ptr: int) -> None:
        """Returns a region that ``alloc`` gave."""
        ...

    def record_event(self, stream: int) -> Any:
        """An event that completes once all work issued on ``stream`` so far has finished."""
        ...

    def query_event(self, event: Any) -> bool:
        """Whether ``event`` has completed, without waiting."""
        ...

    def synchronize_event(self, event: Any) -> None:
        """Waits until ``event`` has completed."""
        ...

    def release_event(self, event: Any) -> None:
        """The allocator is done with ``event``."""
        ...

    def mem_info(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the underlying memory, or None if unknown."""
        ...
