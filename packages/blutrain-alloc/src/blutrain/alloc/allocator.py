"""CachingAllocator: the native caching allocator with typed statistics, snapshots and traces.

``malloc``, ``free``, ``record_stream``, ``empty_cache`` and ``reset_peak`` are the native methods
themselves (one C++ call each); only the reporting methods below run Python.
"""

from __future__ import annotations

from blutrain.alloc import _core
from blutrain.alloc.provider import Provider
from blutrain.alloc.snapshot import SegmentSnapshot, TraceEvent, segments_from_raw, trace_from_raw
from blutrain.alloc.stats import AllocatorStats

__all__ = [
    "LARGE_ROUNDING",
    "LARGE_SEGMENT_SIZE",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "SMALL_SEGMENT_SIZE",
    "SMALL_SIZE",
    "CachingAllocator",
]

MIN_BLOCK_SIZE: int = _core.MIN_BLOCK_SIZE
SMALL_SIZE: int = _core.SMALL_SIZE
SMALL_SEGMENT_SIZE: int = _core.SMALL_SEGMENT_SIZE
LARGE_SEGMENT_SIZE: int = _core.LARGE_SEGMENT_SIZE
MIN_LARGE_ALLOC: int = _core.MIN_LARGE_ALLOC
LARGE_ROUNDING: int = _core.LARGE_ROUNDING


class CachingAllocator(_core.AllocatorCore):
    """A caching allocator over ``provider``, with PyTorch's CUDA caching-allocator semantics.

    - ``malloc(size, stream=0) -> int``: a pointer to at least ``size`` bytes, usable in stream order on
      ``stream``. Sizes round up to 512 B; requests up to 1 MiB come from 2 MiB segments (small pool),
      larger ones from 20 MiB segments, and requests of 10 MiB or more get their own segment rounded to
      2 MiB. The smallest cached free block of the same stream that fits is reused and split.
    - ``free(ptr)``: the block returns to its stream's pool at once (coalescing with free neighbours),
      or, if ``record_stream`` named other streams, once an event recorded on each of them completes.
    - ``record_stream(ptr, stream)``: the block is also used on ``stream``.
    - ``empty_cache()``: waits for pending events, then returns every wholly free segment to the provider.
    - When the provider runs out, the allocator empties its cache and retries once, then raises
      ``OutOfMemoryError``.

    ``expandable_segments`` (PyTorch's ``expandable_segments:True``; the provider must have expandable
    memory, see ``ExpandableProvider``): instead of new segments, each stream and pool reserves one range
    of addresses and maps physical chunks (the provider's granularity, 2 MiB on CUDA) at the end of its
    mapped memory when no cached block fits. Free space at that end merges with the new chunks, so memory
    grows by what is missing instead of by a segment, and ``empty_cache()`` unmaps every chunk that lies
    wholly inside a free block. A run of mapped memory is one segment in statistics and snapshots
    (``reserved_bytes`` counts mapped bytes).

    ``record_stacks`` keeps the Python stack of each live allocation for ``memory_snapshot``;
    ``trace_capacity`` keeps the last that many allocator events for ``trace()``.
    """

    def __init__(
        self,
        provider: Provider,
        *,
        expandable_segments: bool = False,
        record_stacks: bool = False,
        trace_capacity: int = 0,
    ) -> None:
        if not isinstance(expandable_segments, bool):
            raise TypeError(
                f"CachingAllocator(expandable_segments): expected a bool, got {expandable_segments!r}"
            )
        if not isinstance(record_stacks, bool):
            raise TypeError(f"CachingAllocator(record_stacks): expected a bool, got {record_stacks!r}")
        if not isinstance(trace_capacity, int) or trace_capacity < 0:
            raise ValueError(
                f"CachingAllocator(trace_capacity): expected an int >= 0, got {trace_capacity!r}"
            )
        super().__init__(provider, record_stacks, trace_capacity, expandable_segments)

    def stats(self) -> AllocatorStats:
        """The counters now."""
        return AllocatorStats(**self._raw_stats())

    def memory_snapshot(self, include_stacks: bool = False) -> list[SegmentSnapshot]:
        """Every segment, by address, with the blocks that tile it. Stacks are included only when
        ``include_stacks`` is true and were recorded (``record_stacks``) at allocation."""
        return segments_from_raw(self._raw_snapshot(include_stacks))

    def trace(self) -> list[TraceEvent]:
        """The last ``trace_capacity`` allocator events, oldest first."""
        return trace_from_raw(self._raw_trace())

    def __repr__(self) -> str:
        s = self._raw_stats()
        expandable = " expandable_segments" if self.expandable_segments else ""
        return (
            f"<CachingAllocator provider={type(self.provider).__name__}{expandable} allocated={s['allocated_bytes']}"
            f" reserved={s['reserved_bytes']} segments={s['segment_count']}>"
        )
