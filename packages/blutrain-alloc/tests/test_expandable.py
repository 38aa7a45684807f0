"""Expandable segments: one reserved range per stream and pool, grown by mapping 2 MiB chunks of host memory
(HostProvider's expandable memory) and shrunk by empty_cache()."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest

from blutrain.alloc import (
    AllocatorError,
    BlockState,
    CachingAllocator,
    ExpandableProvider,
    FunctionProvider,
    HostProvider,
    OutOfMemoryError,
    TraceAction,
    load_snapshot,
    save_snapshot,
)
from blutrain.alloc.cupy import CONF_VARIABLE, conf_from_env

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 2 * MiB


def new_allocator(limit: int | None = None) -> tuple[CachingAllocator, HostProvider]:
    provider = HostProvider(limit)
    return CachingAllocator(provider, expandable_segments=True), provider


def layout(allocator: CachingAllocator) -> list[tuple[int, list[tuple[int, str]]]]:
    """(segment size, [(block size, state)]) of every segment, in MiB."""
    return [
        (s.size // MiB, [(b.size // MiB, b.state.value) for b in s.blocks]) for s in allocator.memory_snapshot()
    ]


def test_an_expandable_segment_grows_in_place_with_contiguous_addresses() -> None:
    allocator, provider = new_allocator()
    ptrs = [allocator.malloc(4 * MiB) for _ in range(5)]
    assert [p - ptrs[0] for p in ptrs] == [0, 4 * MiB, 8 * MiB, 12 * MiB, 16 * MiB]
    assert ptrs[0] % CHUNK == 0
    (segment,) = allocator.memory_snapshot()
    assert (segment.address, segment.size, segment.expandable, segment.pool) == (ptrs[0], 20 * MiB, True, "large")
    stats = allocator.stats()
    assert (stats.reserved_bytes, stats.segment_count, stats.segment_alloc_count) == (20 * MiB, 1, 5)
    assert (provider.mapped_bytes, provider.live_reservations, provider.reservation_count) == (20 * MiB, 1, 1)
    assert provider.live_allocations == 0


def test_free_space_at_the_end_of_the_mapped_memory_merges_with_new_chunks() -> None:
    allocator, _ = new_allocator()
    first = allocator.malloc(4 * MiB)
    last = allocator.malloc(4 * MiB)
    allocator.free(last)  # 4 MiB free at the end
    big = allocator.malloc(10 * MiB)  # maps 6 MiB more, not 10
    assert big == last
    assert allocator.stats().reserved_bytes == 14 * MiB
    assert layout(allocator) == [(14, [(4, "allocated"), (10, "allocated")])]
    allocator.free(first)


def test_a_small_rest_at_the_end_stays_free_for_the_next_growth() -> None:
    allocator, _ = new_allocator()
    a = allocator.malloc(3 * MiB)  # maps 4 MiB; the 1 MiB rest stays free at the end
    b = allocator.malloc(5 * MiB)  # the rest plus 4 MiB more
    assert b == a + 3 * MiB
    assert layout(allocator) == [(8, [(3, "allocated"), (5, "allocated")])]
    assert allocator.stats().reserved_bytes == allocator.stats().allocated_bytes == 8 * MiB


def test_small_requests_grow_the_small_pools_range() -> None:
    allocator, provider = new_allocator()
    ptrs = [allocator.malloc(768 * KiB) for _ in range(4)]
    assert [p - ptrs[0] for p in ptrs] == [0, 768 * KiB, 1536 * KiB, 2304 * KiB]
    (segment,) = allocator.memory_snapshot()
    assert (segment.pool, segment.size) == ("small", 4 * MiB)
    assert provider.live_reservations == 1


def test_empty_cache_unmaps_the_free_chunks_at_the_end() -> None:
    allocator, provider = new_allocator()
    keep = allocator.malloc(3 * MiB)
    drop = allocator.malloc(8 * MiB)
    allocator.free(drop)
    allocator.empty_cache()
    # The chunk that `keep` shares with the free rest stays mapped; the 8 MiB after it go back.
    assert layout(allocator) == [(4, [(3, "allocated"), (1, "free")])]
    stats = allocator.stats()
    assert (stats.reserved_bytes, stats.segment_free_count) == (4 * MiB, 1)
    assert provider.mapped_bytes == 4 * MiB
    again = allocator.malloc(8 * MiB)  # grows again at the same place
    assert again == drop
    allocator.free(keep)


def test_empty_cache_unmaps_wholly_free_chunks_in_the_middle_and_growth_refills_the_hole() -> None:
    allocator, provider = new_allocator()
    left, middle, right = (allocator.malloc(4 * MiB) for _ in range(3))
    allocator.free(middle)
    allocator.empty_cache()
    # The hole splits the mapped memory into two segments of one range.
    snapshot = allocator.memory_snapshot()
    assert [(s.address, s.size) for s in snapshot] == [(left, 4 * MiB), (right, 4 * MiB)]
    stats = allocator.stats()
    assert (stats.segment_count, stats.reserved_bytes, provider.live_reservations) == (2, 8 * MiB, 1)
    refill = allocator.malloc(4 * MiB)  # mapping the hole costs 4 MiB, the end would too: the hole is first
    assert refill == middle
    assert layout(allocator) == [(12, [(4, "allocated")] * 3)]
    assert allocator.stats().segment_count == 1


def test_empty_cache_returns_a_range_with_nothing_mapped_and_a_later_request_reserves_anew() -> None:
    allocator, provider = new_allocator()
    ptrs = [allocator.malloc(size) for size in (100, 5 * MiB, 7 * MiB)]
    for ptr in ptrs:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_snapshot() == []
    assert (provider.mapped_bytes, provider.live_reservations, provider.used_bytes) == (0, 0, 0)
    stats = allocator.stats()
    assert (stats.reserved_bytes, stats.segment_count, stats.block_count) == (0, 0, 0)
    allocator.malloc(MiB + 1)
    assert (provider.live_reservations, provider.reservation_count) == (1, 3)


def test_each_stream_and_pool_has_its_own_range() -> None:
    allocator, provider = new_allocator()
    for stream in (0, 1):
        allocator.malloc(100, stream)
        allocator.malloc(3 * MiB, stream)
    assert provider.live_reservations == 4
    assert sorted((s.stream, s.pool) for s in allocator.memory_snapshot()) == [
        (0, "large"),
        (0, "small"),
        (1, "large"),
        (1, "small"),
    ]


def test_a_range_reserves_the_providers_total_memory() -> None:
    allocator, provider = new_allocator(limit=64 * MiB)
    a = allocator.malloc(60 * MiB)
    allocator.free(a)
    b = allocator.malloc(62 * MiB)  # grows the same range: it has room for the whole 64 MiB
    assert (a, provider.reservation_count) == (b, 1)


def fragmenting_pattern(allocator: CachingAllocator) -> None:
    """Alternating 5 and 3 MiB blocks, every 3 MiB block freed, then one 16 MiB request that no free
    piece fits."""
    ptrs = [allocator.malloc(size) for _ in range(8) for size in (5 * MiB, 3 * MiB)]
    for ptr in ptrs[1::2]:
        allocator.free(ptr)
    allocator.malloc(16 * MiB)


def test_a_fragmenting_pattern_reuses_the_holes_physical_memory_instead_of_reserving_more() -> None:
    classic = CachingAllocator(HostProvider())
    fragmenting_pattern(classic)
    expandable, provider = new_allocator()
    fragmenting_pattern(expandable)
    old, new = classic.stats(), expandable.stats()
    # Classic: four 20 MiB segments with free pieces and free ends that fit no 16 MiB, so a fifth segment.
    assert sorted(s.size // MiB for s in classic.memory_snapshot()) == [16, 20, 20, 20, 20]
    # Expandable: growing past the peak (64 MiB) first unmaps the whole chunk inside each 3 MiB hole (1 MiB
    # partial chunks stay, shared with the neighbours); the request then takes the free 3 MiB at the end of
    # the range and 14 MiB mapped after it, paid for by the holes' chunks: reserved never passes 64 MiB.
    assert provider.reservation_count == 1
    assert layout(expandable) == [(6, [(5, "allocated"), (1, "free")])] * 7 + [
        (22, [(5, "allocated"), (16, "allocated"), (1, "free")])
    ]
    assert (new.reserved_bytes, new.reserved_bytes_peak, provider.mapped_bytes) == (64 * MiB, 64 * MiB, 64 * MiB)
    assert (old.fragmentation_bytes, new.fragmentation_bytes) == (40 * MiB, 8 * MiB)


def test_a_growth_below_the_peak_keeps_holes_mapped_and_one_past_it_unmaps_them_first() -> None:
    allocator, provider = new_allocator()
    for ptr in [allocator.malloc(6 * MiB), allocator.malloc(6 * MiB)]:
        allocator.free(ptr)
    allocator.empty_cache()  # nothing mapped now; the peak stays 12 MiB
    first, _second, _third = (allocator.malloc(2 * MiB) for _ in range(3))
    allocator.free(first)  # a 2 MiB hole (one whole chunk) before two live blocks
    unmaps = allocator.stats().segment_free_count
    allocator.malloc(4 * MiB)  # fits no free block: grows 6 -> 10 MiB, below the peak
    assert (allocator.stats().segment_free_count, provider.mapped_bytes) == (unmaps, 10 * MiB)
    allocator.malloc(4 * MiB)  # 10 + 4 would pass the peak: the hole's chunk goes back first
    stats = allocator.stats()
    assert stats.segment_free_count == unmaps + 1
    assert (stats.reserved_bytes, stats.reserved_bytes_peak, provider.mapped_bytes) == (12 * MiB, 12 * MiB, 12 * MiB)


def test_statistics_count_mapped_bytes_as_reserved_and_each_map_and_unmap() -> None:
    allocator, _ = new_allocator()
    allocator.trace_capacity = 100
    a = allocator.malloc(3 * MiB)
    b = allocator.malloc(3 * MiB)
    allocator.free(b)
    allocator.empty_cache()
    stats = allocator.stats()
    assert (stats.segment_alloc_count, stats.segment_free_count) == (2, 1)
    assert (stats.reserved_bytes, stats.reserved_bytes_peak) == (4 * MiB, 6 * MiB)
    segment_events = [
        (e.action, e.address - a, e.size // MiB, e.reserved_bytes // MiB)
        for e in allocator.trace()
        if e.action in (TraceAction.SEGMENT_ALLOC, TraceAction.SEGMENT_FREE)
    ]
    assert segment_events == [
        (TraceAction.SEGMENT_ALLOC, 0, 4, 4),
        (TraceAction.SEGMENT_ALLOC, 4 * MiB, 2, 6),
        (TraceAction.SEGMENT_FREE, 4 * MiB, 2, 4),
    ]


def test_out_of_memory_unmaps_cached_chunks_of_other_streams_and_retries_once() -> None:
    allocator, provider = new_allocator(limit=16 * MiB)
    cached = allocator.malloc(12 * MiB, stream=1)
    allocator.free(cached)  # 12 MiB mapped for stream 1, free
    ptr = allocator.malloc(8 * MiB, stream=0)  # needs 8 MiB: only after stream 1's chunks go back
    stats = allocator.stats()
    assert (stats.oom_retries, stats.oom_count) == (1, 0)
    assert stats.reserved_bytes == provider.mapped_bytes == 8 * MiB
    assert provider.live_reservations == 1  # stream 1's range went back with its chunks
    allocator.free(ptr)


def test_when_mapping_fails_after_the_retry_out_of_memory_error_reports_the_numbers() -> None:
    allocator, provider = new_allocator(limit=16 * MiB)
    held = allocator.malloc(9 * MiB)  # 10 MiB mapped
    with pytest.raises(OutOfMemoryError) as info:
        allocator.malloc(8 * MiB)  # 1 MiB free at the end + 8 MiB more > 6 MiB left
    error = info.value
    assert (error.requested, error.allocated, error.reserved) == (8 * MiB, 9 * MiB, 10 * MiB)
    assert error.largest_free_block == MiB
    assert (error.provider_free, error.provider_total) == (6 * MiB, 16 * MiB)
    stats = allocator.stats()
    assert (stats.oom_retries, stats.oom_count, stats.reserved_bytes) == (1, 1, 10 * MiB)
    assert provider.mapped_bytes == 10 * MiB
    allocator.malloc(6 * MiB)  # still usable: 1 MiB free at the end + 6 MiB fits
    allocator.free(held)


def test_dropping_the_allocator_unmaps_and_releases_everything() -> None:
    allocator, provider = new_allocator()
    allocator.malloc(100)
    allocator.malloc(15 * MiB, stream=3)
    assert provider.live_reservations == 2
    del allocator
    gc.collect()
    assert (provider.mapped_bytes, provider.live_reservations, provider.used_bytes) == (0, 0, 0)


def test_a_provider_without_expandable_memory_is_refused() -> None:
    libc = ctypes.CDLL(None)
    alloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    free = ctypes.cast(libc.free, ctypes.c_void_p).value
    assert alloc is not None and free is not None
    with pytest.raises(AllocatorError, match=r"expandable_segments=True.*expected a provider with expandable memory"):
        CachingAllocator(FunctionProvider(alloc, free), expandable_segments=True)
    with pytest.raises(TypeError, match="expected a bool"):
        CachingAllocator(HostProvider(), expandable_segments="yes")  # type: ignore[arg-type]
    assert not CachingAllocator(HostProvider()).expandable_segments


class PythonExpandableProvider:
    """Expandable memory written in Python (over a HostProvider), logging its calls; `during_map` runs
    inside map() as a __del__ freeing another block could."""

    def __init__(self, limit: int | None = None, granularity: int = CHUNK) -> None:
        self.host = HostProvider(limit)
        self.calls: list[tuple[str, int]] = []
        self.during_map: list[object] = []
        self._granularity = granularity

    def alloc(self, size: int) -> int:
        raise AssertionError("an allocator with expandable segments never asks for a classic segment")

    def free(self, ptr: int) -> None:
        raise AssertionError("an allocator with expandable segments never frees a classic segment")

    def record_event(self, stream: int) -> int:
        return self.host.record_event(stream)

    def query_event(self, event: int) -> bool:
        return self.host.query_event(event)

    def synchronize_event(self, event: int) -> None:
        self.host.synchronize_event(event)

    def release_event(self, event: int) -> None:
        self.host.release_event(event)

    def mem_info(self) -> tuple[int, int] | None:
        return self.host.mem_info()

    def granularity(self) -> int:
        return self._granularity

    def reserve(self, size: int) -> int:
        self.calls.append(("reserve", size))
        return self.host.reserve(size)

    def map(self, address: int, size: int) -> bool:
        self.calls.append(("map", size))
        while self.during_map:
            action = self.during_map.pop()
            assert callable(action)
            action()
        return self.host.map(address, size)

    def unmap(self, address: int, size: int) -> None:
        self.calls.append(("unmap", size))
        self.host.unmap(address, size)

    def release(self, base: int, size: int) -> None:
        self.calls.append(("release", size))
        self.host.release(base, size)


def test_a_provider_written_in_python_supplies_expandable_memory() -> None:
    provider = PythonExpandableProvider(limit=64 * MiB)
    assert isinstance(provider, ExpandableProvider)
    allocator = CachingAllocator(provider, expandable_segments=True)
    ptr = allocator.malloc(5 * MiB)
    allocator.free(ptr)
    allocator.empty_cache()
    assert provider.calls == [("reserve", 64 * MiB), ("map", 6 * MiB), ("unmap", 6 * MiB), ("release", 64 * MiB)]


def test_a_granularity_that_is_not_a_multiple_of_512_bytes_is_refused() -> None:
    with pytest.raises(AllocatorError, match=r"granularity\(\) to be a multiple of 512 bytes > 0, got 1000"):
        CachingAllocator(PythonExpandableProvider(granularity=1000), expandable_segments=True)


def test_a_free_that_runs_inside_map_leaves_the_allocator_consistent() -> None:
    provider = PythonExpandableProvider()
    allocator = CachingAllocator(provider, expandable_segments=True)
    a = allocator.malloc(3 * MiB)
    b = allocator.malloc(5 * MiB)
    provider.during_map.append(lambda: allocator.free(b))  # frees the block before the chunks being mapped
    c = allocator.malloc(6 * MiB)
    snapshot = allocator.memory_snapshot()
    for segment in snapshot:
        assert sum(blk.size for blk in segment.blocks) == segment.size
    assert allocator.stats().reserved_bytes == provider.host.mapped_bytes == sum(s.size for s in snapshot)
    assert {blk.address for s in snapshot for blk in s.blocks if blk.state is BlockState.ALLOCATED} == {a, c}
    allocator.free(a)
    allocator.free(c)
    allocator.empty_cache()
    assert (provider.host.mapped_bytes, provider.host.live_reservations) == (0, 0)


def test_host_provider_expandable_memory_checks_its_books() -> None:
    provider = HostProvider(limit=8 * MiB)
    assert provider.granularity() == CHUNK
    base = provider.reserve(16 * MiB)
    assert base % CHUNK == 0
    assert provider.map(base, 4 * MiB)
    ctypes.memset(base, 1, 4 * MiB)
    with pytest.raises(ValueError, match="already mapped"):
        provider.map(base + CHUNK, 4 * MiB)
    assert not provider.map(base + 4 * MiB, 6 * MiB)  # over the limit: nothing mapped
    assert provider.used_bytes == provider.mapped_bytes == 4 * MiB
    assert provider.mem_info() == (4 * MiB, 8 * MiB)
    with pytest.raises(ValueError, match="multiples of 2097152"):
        provider.map(base + 512, CHUNK)
    with pytest.raises(ValueError, match="inside one reserved range"):
        provider.map(base + 16 * MiB, CHUNK)
    with pytest.raises(ValueError, match="still mapped"):
        provider.release(base, 16 * MiB)
    provider.unmap(base, 4 * MiB)
    with pytest.raises(ValueError, match="is not mapped"):
        provider.unmap(base, CHUNK)
    assert provider.map(base, CHUNK)  # mapped again, it reads zeros
    assert ctypes.string_at(base, 16) == bytes(16)
    provider.unmap(base, CHUNK)
    provider.release(base, 16 * MiB)
    with pytest.raises(ValueError, match="returned by reserve"):
        provider.release(base, 16 * MiB)
    assert (provider.live_reservations, provider.used_bytes) == (0, 0)


def test_snapshot_files_keep_whether_a_segment_is_expandable(tmp_path: Path) -> None:
    allocator, _ = new_allocator()
    allocator.malloc(3 * MiB)
    path = save_snapshot(tmp_path / "snapshot.json", allocator.memory_snapshot())
    (segment,) = load_snapshot(path).segments
    assert segment.expandable
    assert tuple(load_snapshot(path).segments) == tuple(allocator.memory_snapshot())


@pytest.mark.parametrize(
    ("value", "options"),
    [
        ("", {}),
        ("expandable_segments:True", {"expandable_segments": True}),
        (" expandable_segments : false ,", {"expandable_segments": False}),
    ],
)
def test_blutrain_alloc_conf_turns_expandable_segments_on(
    monkeypatch: pytest.MonkeyPatch, value: str, options: dict[str, bool]
) -> None:
    monkeypatch.setenv(CONF_VARIABLE, value)
    assert conf_from_env() == options


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("max_split_size_mb:128", "expected the option expandable_segments, got 'max_split_size_mb'"),
        ("expandable_segments:yes", "expected expandable_segments:True or :False, got 'expandable_segments:yes'"),
    ],
)
def test_blutrain_alloc_conf_names_what_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv(CONF_VARIABLE, value)
    with pytest.raises(AllocatorError, match=message):
        conf_from_env()
