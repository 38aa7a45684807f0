"""Out of memory: empty the cache and retry once, then raise OutOfMemoryError with the numbers."""

from __future__ import annotations

import pickle

import pytest

from blutrain.alloc import CachingAllocator, HostProvider, OutOfMemoryError, TraceAction

MiB = 1 << 20


def test_a_provider_failure_frees_the_cache_and_the_retry_succeeds() -> None:
    provider = HostProvider(limit=24 * MiB)
    allocator = CachingAllocator(provider)
    cached = allocator.malloc(12 * MiB)  # own 12 MiB segment
    allocator.free(cached)  # stays cached: 12 MiB reserved, 0 allocated
    # Another stream cannot use the cached block; its 20 MiB segment does not fit beside it (12 + 20 > 24),
    # so the cache is emptied and the provider asked again.
    small = allocator.malloc(MiB + 1, stream=1)
    stats = allocator.stats()
    assert stats.oom_retries == 1
    assert stats.oom_count == 0
    assert stats.segment_free_count == 1
    assert stats.reserved_bytes == 20 * MiB
    assert provider.used_bytes == 20 * MiB
    assert [s.size for s in allocator.memory_snapshot()] == [20 * MiB]
    allocator.free(small)


def test_when_the_retry_fails_too_out_of_memory_error_reports_the_numbers() -> None:
    provider = HostProvider(limit=24 * MiB)
    allocator = CachingAllocator(provider)
    held = allocator.malloc(20 * MiB)  # own 20 MiB segment
    allocator.malloc(100)  # a 2 MiB small segment, mostly free
    with pytest.raises(OutOfMemoryError) as info:
        allocator.malloc(3 * MiB + 5)
    error = info.value
    assert isinstance(error, MemoryError)
    assert error.requested == 3 * MiB + 5
    assert error.rounded == 3 * MiB + 512
    assert error.allocated == 20 * MiB + 512
    assert error.reserved == 22 * MiB
    assert error.largest_free_block == 2 * MiB - 512
    assert (error.provider_free, error.provider_total) == (2 * MiB, 24 * MiB)
    message = str(error)
    assert "tried to allocate 3.00 MiB (3,145,733 bytes, a block of 3.00 MiB)" in message
    assert "the provider has 2.00 MiB free of 24.00 MiB" in message
    assert "20.00 MiB allocated and 22.00 MiB reserved" in message
    assert "largest free block 2.00 MiB" in message
    stats = allocator.stats()
    assert (stats.oom_retries, stats.oom_count) == (1, 1)
    allocator.free(held)


def test_after_an_out_of_memory_error_the_allocator_still_works() -> None:
    allocator = CachingAllocator(HostProvider(limit=4 * MiB))
    with pytest.raises(OutOfMemoryError):
        allocator.malloc(5 * MiB)
    ptr = allocator.malloc(MiB)
    allocator.free(ptr)
    assert allocator.stats().allocated_bytes == 0


def test_the_retry_waits_for_pending_events_so_their_segments_can_be_returned() -> None:
    provider = HostProvider(limit=32 * MiB)
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(12 * MiB)
    allocator.record_stream(ptr, 1)
    allocator.free(ptr)  # pending until stream 1 completes, which nobody says
    allocator.malloc(12 * MiB, stream=2)
    allocator.malloc(MiB + 1, stream=2)  # 20 MiB more fit only once the pending segment is returned
    assert provider.outstanding_events == 0
    assert allocator.stats().pending_bytes == 0


def test_an_unsatisfiable_request_raises_without_asking_the_provider() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    with pytest.raises(OutOfMemoryError, match="tried to allocate"):
        allocator.malloc(1 << 62)
    assert provider.live_allocations == 0


def test_a_provider_without_mem_info_says_so_in_the_message() -> None:
    allocator = CachingAllocator(HostProvider())  # no limit: it cannot tell its free memory
    with pytest.raises(OutOfMemoryError, match="does not report its free memory"):
        allocator.malloc(1 << 62)


def test_out_of_memory_is_recorded_in_the_trace() -> None:
    allocator = CachingAllocator(HostProvider(limit=2 * MiB), trace_capacity=16)
    with pytest.raises(OutOfMemoryError):
        allocator.malloc(4 * MiB)
    assert [e.action for e in allocator.trace()] == [TraceAction.OOM]
    assert allocator.trace()[0].size == 4 * MiB


def test_out_of_memory_error_survives_pickling() -> None:
    error = OutOfMemoryError(
        requested=10,
        rounded=512,
        allocated=1,
        reserved=2,
        largest_free_block=0,
        provider_free=3,
        provider_total=4,
    )
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error)
    assert copy.provider_total == 4
