"""AllocatorStats: the allocator's counters at one moment, in bytes and counts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from blutrain.alloc.units import format_bytes

__all__ = ["AllocatorStats"]


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """Counters of a CachingAllocator. ``*_peak`` values are maxima since creation or ``reset_peak()``.

    Bytes: ``allocated`` counts live blocks (a request rounded up to 512 B, or a whole unsplit block);
    ``requested`` what callers asked for; ``reserved`` every segment taken from the provider; ``active``
    allocated plus blocks freed by the caller but still waiting for stream events (``pending``).
    Counts: ``alloc_count``/``free_count``/``cache_hits``/``splits``/``merges``/``oom_retries``/``oom_count``
    and the segment counters are totals since creation; ``*_count`` of blocks and segments are current.
    """

    allocated_bytes: int
    allocated_bytes_peak: int
    requested_bytes: int
    requested_bytes_peak: int
    reserved_bytes: int
    reserved_bytes_peak: int
    active_bytes: int
    active_bytes_peak: int
    pending_bytes: int
    segment_count: int
    segment_count_peak: int
    block_count: int
    allocation_count: int
    free_block_count: int
    pending_block_count: int
    alloc_count: int
    free_count: int
    cache_hits: int
    segment_alloc_count: int
    segment_free_count: int
    splits: int
    merges: int
    oom_retries: int
    oom_count: int
    largest_free_block: int

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated: cached free blocks plus blocks waiting for events."""
        return self.reserved_bytes - self.allocated_bytes

    def summary(self) -> str:
        """A two-column table of every counter, byte counts in KiB/MiB/GiB."""
        rows = [(f.name, getattr(self, f.name)) for f in fields(self)]
        rows.append(("fragmentation_bytes", self.fragmentation_bytes))
        width = max(len(name) for name, _ in rows)
        lines = []
        for name, value in rows:
            shown = format_bytes(value) if "bytes" in name or name == "largest_free_block" else str(value)
            lines.append(f"{name:<{width}}  {shown}")
        return "\n".join(lines)
