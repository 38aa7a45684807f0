"""Statistics: counters, peaks, fragmentation, and their formatting."""

from __future__ import annotations

import pytest

from blutrain.alloc import AllocatorStats, CachingAllocator, HostProvider, format_bytes

KiB = 1 << 10
MiB = 1 << 20


def test_counters_follow_a_scripted_sequence_exactly() -> None:
    allocator = CachingAllocator(HostProvider())
    a = allocator.malloc(1000)  # new 2 MiB segment, split
    b = allocator.malloc(3000)  # from the rest, split
    allocator.free(a)  # no free neighbour: no merge
    c = allocator.malloc(800)  # reuses a's 1 KiB block exactly: cache hit, no split
    allocator.free(b)  # merges with the free rest
    allocator.free(c)  # merges with the (b + rest) block
    stats = allocator.stats()
    assert stats.alloc_count == 3
    assert stats.free_count == 3
    assert stats.cache_hits == 2
    assert stats.segment_alloc_count == 1
    assert stats.splits == 2
    assert stats.merges == 2
    assert (stats.segment_count, stats.block_count, stats.allocation_count) == (1, 1, 0)
    assert stats.allocated_bytes_peak == 1024 + 3072
    assert stats.requested_bytes_peak == 4000
    assert stats.reserved_bytes == 2 * MiB


def test_peaks_hold_the_maximum_until_reset_and_then_the_current_value() -> None:
    allocator = CachingAllocator(HostProvider())
    big = allocator.malloc(12 * MiB)
    small = allocator.malloc(KiB)
    allocator.free(big)
    stats = allocator.stats()
    assert stats.allocated_bytes == KiB
    assert stats.allocated_bytes_peak == 12 * MiB + KiB
    assert stats.active_bytes_peak == 12 * MiB + KiB
    allocator.empty_cache()
    assert allocator.stats().reserved_bytes_peak == 14 * MiB
    allocator.reset_peak()
    stats = allocator.stats()
    assert stats.allocated_bytes_peak == KiB
    assert stats.reserved_bytes_peak == 2 * MiB
    assert stats.segment_count_peak == 1
    allocator.free(small)


def test_fragmentation_is_reserved_minus_allocated_and_largest_free_block_is_exact() -> None:
    allocator = CachingAllocator(HostProvider())
    ptrs = [allocator.malloc(64 * KiB) for _ in range(8)]
    for ptr in ptrs[::2]:
        allocator.free(ptr)
    stats = allocator.stats()
    assert stats.fragmentation_bytes == 2 * MiB - 4 * 64 * KiB
    assert stats.largest_free_block == 2 * MiB - 8 * 64 * KiB
    assert stats.free_block_count == 5


def test_stats_are_a_typed_frozen_record() -> None:
    stats = CachingAllocator(HostProvider()).stats()
    assert isinstance(stats, AllocatorStats)
    with pytest.raises(AttributeError):
        stats.allocated_bytes = 1  # type: ignore[misc]


def test_summary_lists_every_counter_with_bytes_in_binary_units() -> None:
    allocator = CachingAllocator(HostProvider())
    allocator.malloc(3 * MiB)
    summary = allocator.stats().summary()
    assert "reserved_bytes        20.00 MiB" in summary
    assert "allocated_bytes       3.00 MiB" in summary
    assert "alloc_count           1" in summary
    assert "fragmentation_bytes   17.00 MiB" in summary


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3 << 20, "3.00 MiB"),
        (5 << 30, "5.00 GiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes_uses_binary_units(size: int, text: str) -> None:
    assert format_bytes(size) == text
