"""Sizes, pools, best fit, splitting, coalescing, reuse and the errors of malloc/free."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import pytest

from blutrain.alloc import (
    AllocatorError,
    BlockState,
    CachingAllocator,
    FunctionProvider,
    HostProvider,
    InvalidPointerError,
)

KiB = 1 << 10
MiB = 1 << 20


def new_allocator(limit: int | None = None) -> tuple[CachingAllocator, HostProvider]:
    provider = HostProvider(limit)
    return CachingAllocator(provider), provider


def block_at(allocator: CachingAllocator, ptr: int) -> tuple[int, int, BlockState, str]:
    """(segment size, block size, state, pool) of the block starting at ptr."""
    for segment in allocator.memory_snapshot():
        for block in segment.blocks:
            if block.address == ptr:
                return segment.size, block.size, block.state, segment.pool
    raise AssertionError(f"no block at {ptr:#x}")


@pytest.mark.parametrize(("size", "rounded"), [(1, 512), (512, 512), (513, 1024), (1000, 1024), (4097, 4608)])
def test_requests_round_up_to_multiples_of_512_bytes(size: int, rounded: int) -> None:
    allocator, _ = new_allocator()
    allocator.malloc(size)
    stats = allocator.stats()
    assert stats.allocated_bytes == rounded
    assert stats.requested_bytes == size


def test_zero_byte_request_gets_its_own_512_byte_block() -> None:
    allocator, _ = new_allocator()
    a = allocator.malloc(0)
    b = allocator.malloc(0)
    assert a != b
    assert abs(a - b) >= 512
    assert allocator.stats().allocated_bytes == 1024


def test_requests_up_to_1_mib_come_from_2_mib_small_segments() -> None:
    allocator, provider = new_allocator()
    ptr = allocator.malloc(MiB)
    segment_size, block_size, state, pool = block_at(allocator, ptr)
    assert (segment_size, block_size, state, pool) == (2 * MiB, MiB, BlockState.ALLOCATED, "small")
    assert provider.used_bytes == 2 * MiB


def test_requests_between_1_and_10_mib_come_from_20_mib_large_segments() -> None:
    allocator, _ = new_allocator()
    ptr = allocator.malloc(MiB + 1)
    segment_size, block_size, _, pool = block_at(allocator, ptr)
    assert (segment_size, block_size, pool) == (20 * MiB, MiB + 512, "large")


@pytest.mark.parametrize(
    ("size", "segment"), [(10 * MiB, 10 * MiB), (10 * MiB + 1, 12 * MiB), (33 * MiB, 34 * MiB)]
)
def test_requests_of_10_mib_or_more_get_their_own_segment_rounded_to_2_mib(size: int, segment: int) -> None:
    allocator, provider = new_allocator()
    ptr = allocator.malloc(size)
    segment_size, _, _, pool = block_at(allocator, ptr)
    assert (segment_size, pool) == (segment, "large")
    assert provider.used_bytes == segment


def test_small_pool_splits_any_remainder_of_at_least_512_bytes() -> None:
    allocator, _ = new_allocator()
    allocator.malloc(MiB)
    allocator.malloc(MiB - 512)
    blocks = allocator.memory_snapshot()[0].blocks
    assert [(b.size, b.state) for b in blocks] == [
        (MiB, BlockState.ALLOCATED),
        (MiB - 512, BlockState.ALLOCATED),
        (512, BlockState.FREE),
    ]
    assert allocator.stats().splits == 2


def test_large_pool_keeps_a_remainder_of_1_mib_or_less_with_the_allocation() -> None:
    allocator, _ = new_allocator()
    big = allocator.malloc(12 * MiB)  # its own 12 MiB segment
    allocator.free(big)
    ptr = allocator.malloc(11 * MiB)  # best fit: the cached 12 MiB block; the 1 MiB rest is not split off
    assert ptr == big
    assert block_at(allocator, ptr)[1] == 12 * MiB
    assert allocator.stats().allocated_bytes == 12 * MiB
    assert allocator.stats().requested_bytes == 11 * MiB


def test_large_pool_splits_a_remainder_of_more_than_1_mib() -> None:
    allocator, _ = new_allocator()
    ptr = allocator.malloc(2 * MiB)
    blocks = allocator.memory_snapshot()[0].blocks
    assert ptr == blocks[0].address
    assert [(b.size, b.state) for b in blocks] == [
        (2 * MiB, BlockState.ALLOCATED),
        (18 * MiB, BlockState.FREE),
    ]


def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    allocator, _ = new_allocator()
    # One small segment cut into [a 64K][x 4K][b 16K][y 4K][c 32K][z 4K][rest], then a, b, c freed:
    # holes of 64K, 16K and 32K separated by live blocks.
    a, _x, b, _y, c, _z = (
        allocator.malloc(s) for s in (64 * KiB, 4 * KiB, 16 * KiB, 4 * KiB, 32 * KiB, 4 * KiB)
    )
    for ptr in (a, b, c):
        allocator.free(ptr)
    assert allocator.malloc(20 * KiB) == c
    assert allocator.malloc(16 * KiB) == b
    assert allocator.malloc(40 * KiB) == a  # the 12K left of c is too small now


def test_a_freed_block_is_reused_for_the_next_request_on_its_stream() -> None:
    allocator, _ = new_allocator()
    ptr = allocator.malloc(4 * KiB, stream=3)
    allocator.free(ptr)
    assert allocator.malloc(4 * KiB, stream=3) == ptr
    stats = allocator.stats()
    assert (stats.segment_alloc_count, stats.cache_hits) == (1, 1)


def test_a_free_block_of_one_stream_is_not_given_to_another_stream() -> None:
    allocator, _ = new_allocator()
    ptr = allocator.malloc(4 * KiB, stream=1)
    allocator.free(ptr)
    other = allocator.malloc(4 * KiB, stream=2)
    segments = allocator.memory_snapshot()
    assert len(segments) == 2
    assert {s.stream for s in segments} == {1, 2}
    assert block_at(allocator, other)[2] is BlockState.ALLOCATED
    assert other != ptr


def test_free_coalesces_a_block_with_both_free_neighbours() -> None:
    allocator, _ = new_allocator()
    a, b, c = (allocator.malloc(8 * KiB) for _ in range(3))
    allocator.free(a)
    allocator.free(c)  # c merges with the free rest of the segment
    assert len(allocator.memory_snapshot()[0].blocks) == 3
    allocator.free(b)
    blocks = allocator.memory_snapshot()[0].blocks
    assert [(blk.address, blk.size, blk.state) for blk in blocks] == [(a, 2 * MiB, BlockState.FREE)]
    assert allocator.stats().merges == 3


def test_empty_cache_returns_whole_free_segments_and_keeps_used_ones() -> None:
    allocator, provider = new_allocator()
    keep = allocator.malloc(4 * KiB)
    drop = allocator.malloc(12 * MiB)
    allocator.free(drop)
    assert provider.used_bytes == 14 * MiB
    allocator.empty_cache()
    assert provider.used_bytes == 2 * MiB
    assert [s.size for s in allocator.memory_snapshot()] == [2 * MiB]
    assert block_at(allocator, keep)[2] is BlockState.ALLOCATED
    assert allocator.stats().segment_free_count == 1


def test_free_of_a_pointer_that_is_not_live_names_it() -> None:
    allocator, _ = new_allocator()
    ptr = allocator.malloc(100)
    with pytest.raises(InvalidPointerError, match=rf"free\(ptr\).*got {ptr + 512:#x}"):
        allocator.free(ptr + 512)
    allocator.free(ptr)
    with pytest.raises(InvalidPointerError) as info:
        allocator.free(ptr)
    assert info.value.ptr == ptr
    assert isinstance(info.value, ValueError)


def test_negative_size_is_rejected_with_the_size_in_the_message() -> None:
    allocator, _ = new_allocator()
    with pytest.raises(ValueError, match="malloc\\(size\\): expected a size >= 0 bytes, got -5"):
        allocator.malloc(-5)


def test_trace_capacity_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=r"trace_capacity.*got -1"):
        CachingAllocator(HostProvider(), trace_capacity=-1)


def test_dropping_the_allocator_returns_every_segment_to_the_provider() -> None:
    provider = HostProvider()
    allocator = CachingAllocator(provider)
    allocator.malloc(100)
    allocator.malloc(15 * MiB)
    assert provider.live_allocations == 2
    del allocator
    gc.collect()
    assert provider.live_allocations == 0
    assert provider.used_bytes == 0


@pytest.mark.parametrize("expandable", [False, True], ids=["fixed-segments", "expandable-segments"])
def test_allocated_memory_is_writable_over_the_whole_request(expandable: bool) -> None:
    allocator = CachingAllocator(HostProvider(), expandable_segments=expandable)
    sizes = [3000, 700 * KiB, 5 * MiB]
    ptrs = [allocator.malloc(s) for s in sizes]
    for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
        ctypes.memset(ptr, i + 1, size)
    for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
        data = ctypes.string_at(ptr, size)
        assert data == bytes([i + 1]) * size


class PythonHostProvider:
    """A provider written in Python: host memory from libc, counting its calls."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"))
        self.libc.malloc.restype = ctypes.c_void_p
        self.libc.malloc.argtypes = [ctypes.c_size_t]
        self.libc.free.argtypes = [ctypes.c_void_p]
        self.live: set[int] = set()
        self.released: list[object] = []

    def alloc(self, size: int) -> int:
        ptr = int(self.libc.malloc(size))
        self.live.add(ptr)
        return ptr

    def free(self, ptr: int) -> None:
        self.live.remove(ptr)
        self.libc.free(ptr)

    def record_event(self, stream: int) -> object:
        return ("event", stream)

    def query_event(self, event: object) -> bool:
        return True

    def synchronize_event(self, event: object) -> None:
        pass

    def release_event(self, event: object) -> None:
        self.released.append(event)

    def mem_info(self) -> tuple[int, int] | None:
        return None


def test_a_provider_written_in_python_supplies_segments_and_events() -> None:
    provider = PythonHostProvider()
    allocator = CachingAllocator(provider)
    ptr = allocator.malloc(5000, stream=1)
    assert len(provider.live) == 1
    allocator.record_stream(ptr, 7)
    allocator.free(ptr)
    allocator.malloc(64)  # processes the (already complete) event
    assert provider.released == [("event", 7)]
    assert allocator.provider is provider
    allocator.empty_cache()
    del allocator
    gc.collect()
    assert provider.live == set()


def test_a_provider_without_the_provider_methods_is_rejected_by_name() -> None:
    class Incomplete:
        def alloc(self, size: int) -> int:
            return 0

    with pytest.raises(
        TypeError, match="Incomplete missing free, record_event, query_event, synchronize_event"
    ):
        CachingAllocator(Incomplete())  # type: ignore[arg-type]


def test_a_provider_returning_a_non_pointer_is_reported() -> None:
    class Broken(PythonHostProvider):
        def alloc(self, size: int) -> int:
            return "nope"  # type: ignore[return-value]

    allocator = CachingAllocator(Broken())
    with pytest.raises(TypeError, match=r"provider.alloc\(size\): expected to return a pointer.*got 'nope'"):
        allocator.malloc(10)


def test_an_exception_in_a_python_provider_propagates_and_leaves_the_allocator_usable() -> None:
    class Failing(PythonHostProvider):
        fail = True

        def alloc(self, size: int) -> int:
            if self.fail:
                raise RuntimeError("device lost")
            return super().alloc(size)

    provider = Failing()
    allocator = CachingAllocator(provider)
    with pytest.raises(RuntimeError, match="device lost"):
        allocator.malloc(10)
    provider.fail = False
    allocator.malloc(10)
    assert allocator.stats().segment_count == 1


def libc_functions() -> tuple[int, int]:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    alloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    free = ctypes.cast(libc.free, ctypes.c_void_p).value
    assert alloc is not None and free is not None
    return alloc, free


def test_function_provider_allocates_through_c_function_pointers() -> None:
    alloc, free = libc_functions()
    allocator = CachingAllocator(FunctionProvider(alloc, free))
    ptr = allocator.malloc(3 * MiB)
    ctypes.memset(ptr, 7, 3 * MiB)
    allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.stats().reserved_bytes == 0


def test_function_provider_refuses_cross_stream_use_because_it_has_no_events() -> None:
    alloc, free = libc_functions()
    allocator = CachingAllocator(FunctionProvider(alloc, free))
    ptr = allocator.malloc(100, stream=1)
    allocator.record_stream(ptr, 1)  # its own stream: nothing to wait for
    with pytest.raises(AllocatorError, match=r"no stream events.*allocated on \(1\), got stream 2"):
        allocator.record_stream(ptr, 2)


def test_function_provider_rejects_a_null_function_address() -> None:
    with pytest.raises(ValueError, match=r"alloc_address.*got 0"):
        FunctionProvider(0, 1)


def test_a_free_that_runs_inside_a_provider_call_leaves_the_allocator_consistent() -> None:
    """A Python provider can run arbitrary code (a __del__ freeing another block, another thread):
    the allocator calls it only while its own books are in order."""

    class Reentrant(PythonHostProvider):
        def __init__(self) -> None:
            super().__init__()
            self.on_alloc: list[int] = []
            self.on_query: list[int] = []
            self.allocator: CachingAllocator | None = None

        def alloc(self, size: int) -> int:
            assert self.allocator is not None
            while self.on_alloc:
                self.allocator.free(self.on_alloc.pop())
            return super().alloc(size)

        def query_event(self, event: object) -> bool:
            assert self.allocator is not None
            while self.on_query:
                ptr = self.on_query.pop()
                self.allocator.record_stream(ptr, 9)
                self.allocator.free(ptr)  # records another event while the allocator walks its events
            return True

    provider = Reentrant()
    allocator = CachingAllocator(provider)
    provider.allocator = allocator
    small = [allocator.malloc(4 * KiB) for _ in range(3)]
    provider.on_alloc = small[:2]
    big = allocator.malloc(12 * MiB)  # a new segment: the provider frees two small blocks meanwhile
    allocator.record_stream(big, 5)
    allocator.free(big)
    provider.on_query = [small[2]]
    allocator.malloc(100)  # walks the events; the provider frees (and records) another block meanwhile
    allocator.malloc(100)  # the event recorded meanwhile completes now
    snapshot = allocator.memory_snapshot()
    for segment in snapshot:
        assert sum(b.size for b in segment.blocks) == segment.size
        assert all(b.state is not BlockState.PENDING_EVENT for b in segment.blocks)
    stats = allocator.stats()
    assert stats.allocation_count == 2
    assert stats.free_count == 4
    assert stats.pending_bytes == 0
    assert stats.allocated_bytes == sum(
        b.size for s in snapshot for b in s.blocks if b.state is BlockState.ALLOCATED
    )
