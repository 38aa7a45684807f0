"""Per-stream pools and record_stream: a block used on other streams waits for their events."""

from __future__ import annotations

from blutrain.alloc import BlockState, CachingAllocator, HostProvider

KiB = 1 << 10


def states(allocator: CachingAllocator) -> dict[int, BlockState]:
    return {b.address: b.state for s in allocator.memory_snapshot() for b in s.blocks}


def test_a_block_used_on_another_stream_is_not_reused_before_that_streams_work_completes() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(4 * KiB, stream=0)
    allocator.record_stream(ptr, 1)
    allocator.free(ptr)
    assert states(allocator)[ptr] is BlockState.PENDING_EVENT
    other = allocator.malloc(4 * KiB, stream=0)
    assert other != ptr
    allocator.free(other)
    provider.complete(1)
    assert allocator.malloc(4 * KiB, stream=0) == ptr


def test_work_issued_after_the_free_does_not_hold_the_block_back() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(4 * KiB)
    allocator.record_stream(ptr, 1)
    allocator.free(ptr)  # event recorded on stream 1 now
    provider.complete(1)
    provider.record_event(1)  # later work on stream 1, never completed
    assert allocator.malloc(4 * KiB) == ptr


def test_a_block_used_on_several_streams_waits_for_all_of_them() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(4 * KiB)
    allocator.record_stream(ptr, 1)
    allocator.record_stream(ptr, 2)
    allocator.record_stream(ptr, 2)  # named twice, waited for once
    allocator.free(ptr)
    assert provider.outstanding_events == 2
    provider.complete(2)
    spare = allocator.malloc(4 * KiB)
    assert spare != ptr
    assert states(allocator)[ptr] is BlockState.PENDING_EVENT
    provider.complete(1)
    allocator.free(spare)
    assert allocator.malloc(4 * KiB) in {ptr, spare}
    assert states(allocator).get(ptr) is not BlockState.PENDING_EVENT
    assert provider.outstanding_events == 0


def test_recording_the_blocks_own_stream_leaves_it_immediately_reusable() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(4 * KiB, stream=5)
    allocator.record_stream(ptr, 5)
    allocator.free(ptr)
    assert provider.outstanding_events == 0
    assert allocator.malloc(4 * KiB, stream=5) == ptr


def test_pending_blocks_count_as_active_but_not_as_allocated() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(4 * KiB)
    allocator.record_stream(ptr, 1)
    allocator.free(ptr)
    stats = allocator.stats()
    assert (stats.allocated_bytes, stats.pending_bytes, stats.active_bytes) == (0, 4 * KiB, 4 * KiB)
    assert stats.pending_block_count == 1
    provider.complete(1)
    allocator.malloc(1 << 20, stream=9)  # any malloc processes completed events
    stats = allocator.stats()
    assert (stats.pending_bytes, stats.pending_block_count) == (0, 0)


def test_a_pending_block_does_not_coalesce_until_its_events_complete() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    a = allocator.malloc(4 * KiB)
    b = allocator.malloc(4 * KiB)
    allocator.record_stream(a, 1)
    allocator.free(a)
    allocator.free(b)
    blocks = allocator.memory_snapshot()[0].blocks
    assert [blk.state for blk in blocks] == [BlockState.PENDING_EVENT, BlockState.FREE]
    provider.complete(1)
    allocator.malloc(4 * KiB, stream=3)  # processes the event; served from a new stream-3 segment
    (segment,) = [s for s in allocator.memory_snapshot() if s.stream == 0]
    assert [(blk.address, blk.size, blk.state) for blk in segment.blocks] == [(a, 2 << 20, BlockState.FREE)]


def test_empty_cache_waits_for_pending_events_and_returns_the_segment() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(4 * KiB)
    allocator.record_stream(ptr, 1)
    allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_snapshot() == []
    assert provider.used_bytes == 0
    assert provider.outstanding_events == 0
    # waiting meant running stream 1 up to the event: a new event on it is not complete
    event = provider.record_event(1)
    assert not provider.query_event(event)


def test_record_stream_of_a_pointer_that_is_not_live_raises() -> None:
    allocator = CachingAllocator(HostProvider())
    ptr = allocator.malloc(10)
    allocator.free(ptr)
    try:
        allocator.record_stream(ptr, 1)
    except ValueError as error:
        assert "record_stream(ptr)" in str(error)
        assert f"{ptr:#x}" in str(error)
    else:
        raise AssertionError("record_stream of a freed pointer did not raise")


def test_events_of_a_python_provider_are_queried_in_order_and_released() -> None:
    class Clock:
        """A Python provider over HostProvider memory whose events are Python objects."""

        def __init__(self) -> None:
            self.memory = HostProvider()
            self.done: set[int] = set()
            self.queried: list[int] = []
            self.released: list[int] = []
            self.count = 0

        def alloc(self, size: int) -> int:
            return self.memory.alloc(size)

        def free(self, ptr: int) -> None:
            self.memory.free(ptr)

        def record_event(self, stream: int) -> int:
            self.count += 1
            return self.count

        def query_event(self, event: int) -> bool:
            self.queried.append(event)
            return event in self.done

        def synchronize_event(self, event: int) -> None:
            self.done.add(event)

        def release_event(self, event: int) -> None:
            self.released.append(event)

        def mem_info(self) -> tuple[int, int] | None:
            return None

    provider = Clock()
    allocator = CachingAllocator(provider)
    first = allocator.malloc(4 * KiB)
    second = allocator.malloc(4 * KiB)
    for ptr in (first, second):
        allocator.record_stream(ptr, 1)
        allocator.free(ptr)  # events 1 and 2 on stream 1
    allocator.malloc(100)
    assert provider.queried == [1]  # stream order: the second is not asked while the first runs
    provider.done.add(1)
    allocator.malloc(100)
    assert provider.queried == [1, 1, 2]
    assert provider.released == [1]
    allocator.empty_cache()
    assert provider.released == [1, 2]
