"""memory_snapshot() content, stack recording, and the event trace."""

from __future__ import annotations

from blutrain.alloc import BlockState, CachingAllocator, HostProvider, TraceAction

KiB = 1 << 10
MiB = 1 << 20


def allocate_here(allocator: CachingAllocator) -> int:
    return allocator.malloc(3 * KiB)


def test_snapshot_lists_segments_by_address_with_blocks_that_tile_them() -> None:
    allocator = CachingAllocator(HostProvider())
    a = allocator.malloc(1000, stream=4)
    big = allocator.malloc(12 * MiB, stream=4)
    snapshot = allocator.memory_snapshot()
    assert [s.address for s in snapshot] == sorted(s.address for s in snapshot)
    by_pool = {s.pool: s for s in snapshot}
    small = by_pool["small"]
    assert (small.size, small.stream) == (2 * MiB, 4)
    assert [(b.address, b.size, b.requested_size, b.state) for b in small.blocks] == [
        (a, 1024, 1000, BlockState.ALLOCATED),
        (a + 1024, 2 * MiB - 1024, 0, BlockState.FREE),
    ]
    large = by_pool["large"]
    assert [(b.address, b.size, b.state) for b in large.blocks] == [(big, 12 * MiB, BlockState.ALLOCATED)]
    assert small.allocated_bytes == 1024


def test_stacks_are_recorded_only_when_enabled_and_returned_only_when_asked() -> None:
    allocator = CachingAllocator(HostProvider())
    plain = allocate_here(allocator)
    allocator.record_stacks = True
    traced = allocate_here(allocator)
    blocks = {b.address: b for s in allocator.memory_snapshot(include_stacks=True) for b in s.blocks}
    assert blocks[plain].stack is None
    stack = blocks[traced].stack
    assert stack is not None
    assert [f.name for f in stack[-2:]] == [
        "test_stacks_are_recorded_only_when_enabled_and_returned_only_when_asked",
        "allocate_here",
    ]
    assert stack[-1].filename == __file__
    assert stack[-1].line == allocate_here.__code__.co_firstlineno + 1
    assert all(b.stack is None for s in allocator.memory_snapshot() for b in s.blocks)


def test_a_freed_block_forgets_its_stack() -> None:
    allocator = CachingAllocator(HostProvider(), record_stacks=True)
    ptr = allocate_here(allocator)
    allocator.free(ptr)
    assert all(b.stack is None for s in allocator.memory_snapshot(include_stacks=True) for b in s.blocks)


def test_trace_records_every_allocator_event_in_order_with_totals() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider, trace_capacity=100)
    ptr = allocator.malloc(1000)
    allocator.record_stream(ptr, 1)
    allocator.free(ptr)
    provider.complete(1)
    allocator.empty_cache()
    trace = allocator.trace()
    assert [e.action for e in trace] == [
        TraceAction.SEGMENT_ALLOC,
        TraceAction.ALLOC,
        TraceAction.FREE,
        TraceAction.FREE_COMPLETED,
        TraceAction.SEGMENT_FREE,
    ]
    assert [e.seq for e in trace] == [0, 1, 2, 3, 4]
    assert [(e.allocated_bytes, e.active_bytes, e.reserved_bytes) for e in trace] == [
        (0, 0, 2 * MiB),
        (1024, 1024, 2 * MiB),
        (0, 1024, 2 * MiB),
        (0, 0, 2 * MiB),
        (0, 0, 0),
    ]
    assert trace[1].address == ptr


def test_trace_keeps_only_the_most_recent_events() -> None:
    allocator = CachingAllocator(HostProvider(), trace_capacity=3)
    for _ in range(4):
        allocator.free(allocator.malloc(100))
    trace = allocator.trace()
    assert [e.seq for e in trace] == [6, 7, 8]
    assert [e.action for e in trace] == [TraceAction.FREE, TraceAction.ALLOC, TraceAction.FREE]


def test_changing_the_trace_capacity_starts_a_new_trace() -> None:
    allocator = CachingAllocator(HostProvider(), trace_capacity=10)
    allocator.malloc(100)
    allocator.trace_capacity = 0
    allocator.malloc(100)
    assert allocator.trace() == []
