"""Random malloc/free/record_stream/empty_cache sequences keep every invariant of the allocator, with
classic and with expandable segments.

The model keeps the live requests and every stream event the allocator must have recorded, with the
HostProvider's fake stream clock deciding when events complete; after each step the snapshot, the
statistics and the provider's books must agree with it exactly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blutrain.alloc import BlockState, CachingAllocator, HostProvider

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 2 * MiB  # HostProvider's granularity
STREAMS = st.sampled_from([0, 1, 2])
SIZES = st.one_of(
    st.integers(0, 4 * KiB),
    st.integers(4 * KiB, MiB),
    st.integers(MiB + 1, 12 * MiB),
    st.sampled_from([511, 512, 513, MiB - 1, MiB, MiB + 1, 2 * MiB, 10 * MiB - 1, 10 * MiB, 10 * MiB + 1]),
)


def rounded(size: int) -> int:
    return max(512, -(-size // 512) * 512)


@dataclass
class Live:
    size: int
    stream: int
    streams_used: set[int]


@dataclass
class Event:
    stream: int
    ptr: int
    done: bool = False


class AllocatorMachine(RuleBasedStateMachine):
    expandable = False

    def __init__(self) -> None:
        super().__init__()
        self.provider = HostProvider()
        self.allocator = CachingAllocator(self.provider, expandable_segments=self.expandable)
        self.live: dict[int, Live] = {}
        self.events: list[Event] = []  # recorded by the allocator, not yet released
        self.peaks = self.allocator.stats()
        self.peaks_reset = False

    def process_completed_events(self) -> None:
        self.events = [e for e in self.events if not e.done]

    @rule(size=SIZES, stream=STREAMS)
    def malloc(self, size: int, stream: int) -> None:
        ptr = self.allocator.malloc(size, stream)
        self.process_completed_events()
        assert ptr not in self.live
        assert ptr % 512 == 0
        self.live[ptr] = Live(size, stream, set())
        (segment,) = [s for s in self.allocator.memory_snapshot() if s.address <= ptr < s.address + s.size]
        assert segment.stream == stream, "a block is only handed out on the stream of its segment"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        entry = self.live.pop(ptr)
        self.allocator.free(ptr)
        for stream in sorted(entry.streams_used - {entry.stream}):
            self.events.append(Event(stream, ptr))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=STREAMS)
    def record_stream(self, data: st.DataObject, stream: int) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.allocator.record_stream(ptr, stream)
        self.live[ptr].streams_used.add(stream)

    @rule(stream=STREAMS)
    def complete(self, stream: int) -> None:
        self.provider.complete(stream)
        for event in self.events:
            if event.stream == stream:
                event.done = True

    @rule()
    def empty_cache(self) -> None:
        self.allocator.empty_cache()
        self.events = []
        for segment in self.allocator.memory_snapshot():
            assert any(b.state is not BlockState.FREE for b in segment.blocks), (
                "a wholly free segment was kept"
            )
            for block in segment.blocks:
                if segment.expandable and block.state is BlockState.FREE:
                    first_chunk = -(-block.address // CHUNK) * CHUNK
                    assert first_chunk + CHUNK > block.address + block.size, "a wholly free chunk stayed mapped"
        if self.expandable:  # every range left has memory mapped in it
            assert self.provider.live_reservations <= self.allocator.stats().segment_count

    @rule()
    def reset_peak(self) -> None:
        self.allocator.reset_peak()
        self.peaks_reset = True

    @invariant()
    def blocks_tile_their_segments_and_free_neighbours_are_merged(self) -> None:
        for segment in self.allocator.memory_snapshot():
            address = segment.address
            for block in segment.blocks:
                assert block.address == address
                assert block.size > 0 and block.size % 512 == 0
                address += block.size
            assert address == segment.address + segment.size
            for left, right in itertools.pairwise(segment.blocks):
                assert not (left.state is BlockState.FREE and right.state is BlockState.FREE)
            if segment.expandable:  # a run of whole mapped chunks
                assert self.expandable
                assert segment.address % CHUNK == 0 and segment.size % CHUNK == 0
            elif segment.pool == "small":
                assert segment.size == 2 * MiB
            else:
                assert segment.size == 20 * MiB or (
                    segment.size >= 10 * MiB and segment.size % (2 * MiB) == 0
                )

    @invariant()
    def live_blocks_are_exactly_the_live_requests(self) -> None:
        allocated = {
            b.address: (b, s.pool)
            for s in self.allocator.memory_snapshot()
            for b in s.blocks
            if b.state is BlockState.ALLOCATED
        }
        assert set(allocated) == set(self.live)
        for ptr, entry in self.live.items():
            block, pool = allocated[ptr]
            assert block.requested_size == entry.size
            need = rounded(entry.size)
            if need <= MiB:
                assert (pool, block.size) == ("small", need)
            else:  # a large block keeps an unsplit rest of at most 1 MiB
                assert pool == "large"
                assert need <= block.size <= need + MiB
        spans = sorted((ptr, ptr + rounded(entry.size)) for ptr, entry in self.live.items())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "live allocations overlap"

    @invariant()
    def blocks_wait_exactly_for_unprocessed_events(self) -> None:
        pending = {
            b.address
            for s in self.allocator.memory_snapshot()
            for b in s.blocks
            if b.state is BlockState.PENDING_EVENT
        }
        assert pending == {e.ptr for e in self.events}
        assert self.provider.outstanding_events == len(self.events)

    @invariant()
    def statistics_agree_with_the_snapshot_and_the_provider(self) -> None:
        snapshot = self.allocator.memory_snapshot()
        blocks = [b for s in snapshot for b in s.blocks]
        stats = self.allocator.stats()
        by_state = {state: sum(b.size for b in blocks if b.state is state) for state in BlockState}
        assert stats.allocated_bytes == by_state[BlockState.ALLOCATED]
        assert stats.pending_bytes == by_state[BlockState.PENDING_EVENT]
        assert stats.active_bytes == stats.allocated_bytes + stats.pending_bytes
        assert stats.requested_bytes == sum(entry.size for entry in self.live.values())
        assert stats.reserved_bytes == sum(s.size for s in snapshot) == self.provider.used_bytes
        if self.expandable:  # a segment is a run of mapped chunks of one range
            assert stats.segment_count == len(snapshot)
            assert self.provider.mapped_bytes == stats.reserved_bytes
            assert self.provider.live_allocations == 0
            assert self.provider.live_reservations <= 6, "more than one range per stream and pool"
        else:
            assert stats.segment_count == len(snapshot) == self.provider.live_allocations
        assert stats.block_count == len(blocks)
        assert stats.allocation_count == len(self.live)
        assert stats.free_block_count == sum(1 for b in blocks if b.state is BlockState.FREE)
        assert stats.fragmentation_bytes == stats.reserved_bytes - stats.allocated_bytes
        free_sizes = [b.size for b in blocks if b.state is BlockState.FREE]
        assert stats.largest_free_block == max(free_sizes, default=0)
        assert stats.alloc_count - stats.free_count == len(self.live)

    @invariant()
    def mapped_runs_of_one_stream_and_pool_are_separated_by_unmapped_memory(self) -> None:
        runs: dict[tuple[int, str], list[tuple[int, int]]] = {}
        for segment in self.allocator.memory_snapshot():
            runs.setdefault((segment.stream, segment.pool), []).append((segment.address, segment.size))
        for spans in runs.values():
            for (left, size), (right, _) in itertools.pairwise(sorted(spans)):
                assert left + size < right, "two mapped runs touch: they are one segment"

    @invariant()
    def peaks_bound_the_current_values_and_only_grow_until_reset(self) -> None:
        stats = self.allocator.stats()
        names = ("allocated_bytes", "requested_bytes", "reserved_bytes", "active_bytes", "segment_count")
        for name in names:
            assert getattr(stats, name + "_peak") >= getattr(stats, name)
            if not self.peaks_reset:
                assert getattr(stats, name + "_peak") >= getattr(self.peaks, name + "_peak")
        self.peaks = stats
        self.peaks_reset = False


class ExpandableAllocatorMachine(AllocatorMachine):
    expandable = True


MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
AllocatorMachine.TestCase.settings = MACHINE_SETTINGS
ExpandableAllocatorMachine.TestCase.settings = MACHINE_SETTINGS
TestAllocatorInvariants = AllocatorMachine.TestCase
TestExpandableAllocatorInvariants = ExpandableAllocatorMachine.TestCase
