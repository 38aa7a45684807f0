"""The provider contract: where a CachingAllocator gets raw memory and stream events.

Native providers (called from C++ with no Python in between):

- ``HostProvider(limit=None)``: host memory (512-byte aligned) with an optional byte limit, and a fake
  stream clock: work on a stream finishes only when ``complete(stream)`` or ``synchronize_event`` says so.
  It has expandable memory too: virtual memory reserved inaccessible, whose 2 MiB chunks ``map`` makes
  readable and writable (counted against the limit) and ``unmap`` gives back.
- ``FunctionProvider(alloc_address, free_address)``: C functions ``void* alloc(size_t)`` and
  ``void free(void*)`` given by address; it has no events, so blocks stay on their own stream.

Any Python object with the methods of ``Provider`` works too (``blutrain.alloc.cupy`` has the CUDA ones).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from blutrain.alloc._core import FunctionProvider, HostProvider, NativeProvider

__all__ = ["ExpandableProvider", "FunctionProvider", "HostProvider", "NativeProvider", "Provider"]


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


@runtime_checkable
class ExpandableProvider(Provider, Protocol):
    """A provider with expandable memory, which ``CachingAllocator(expandable_segments=True)`` needs:
    ranges of addresses reserved without memory behind them, backed chunk by chunk on demand."""

    def reserve(self, size: int) -> int:
        """The base of a new range of ``size`` bytes (a multiple of ``granularity()``), aligned to
        ``granularity()``, with nothing mapped; 0 when no such range can be had."""
        ...

    def map(self, address: int, size: int) -> bool:
        """Backs ``[address, address + size)`` of a reserved range with memory, readable and writable; False
        (with nothing mapped) when the memory is exhausted. Both are multiples of ``granularity()``."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Gives back the memory behind ``[address, address + size)``, mapped before by ``map``, once the
        work issued on it so far has finished."""
        ...

    def release(self, base: int, size: int) -> None:
        """Returns a range that ``reserve`` gave, with nothing mapped in it any more."""
        ...

    def granularity(self) -> int:
        """The unit of mapping, in bytes (a multiple of 512)."""
        ...
