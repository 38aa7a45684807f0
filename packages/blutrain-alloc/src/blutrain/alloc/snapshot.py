"""What memory_snapshot() and trace() return: segments, their blocks, and the event history."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["BlockSnapshot", "BlockState", "SegmentSnapshot", "StackFrame", "TraceAction", "TraceEvent"]


class BlockState(enum.Enum):
    """Where a block stands: handed out, reusable, or freed but waiting for other streams' events."""

    FREE = "free"
    ALLOCATED = "allocated"
    PENDING_EVENT = "pending_event"


# The native core numbers states and trace actions; these tuples map them back, in the core's order.
_BLOCK_STATES = (BlockState.FREE, BlockState.ALLOCATED, BlockState.PENDING_EVENT)


@dataclass(frozen=True, slots=True)
class StackFrame:
    """One Python frame of an allocation's stack."""

    filename: str
    name: str
    line: int


@dataclass(frozen=True, slots=True)
class BlockSnapshot:
    """A block of a segment. ``requested_size`` is 0 unless allocated; ``stack`` is the Python stack at
    allocation (outermost frame first) when stacks were recorded and asked for, else None."""

    address: int
    size: int
    requested_size: int
    state: BlockState
    stack: tuple[StackFrame, ...] | None


@dataclass(frozen=True, slots=True)
class SegmentSnapshot:
    """One provider allocation and the blocks that tile it, by address. With expandable segments, a
    segment is a run of mapped memory of a reserved range (``expandable`` is true) and ``size`` its
    mapped bytes; the range has one such run unless ``empty_cache()`` unmapped chunks in its middle."""

    address: int
    size: int
    stream: int
    pool: str  # "small" or "large"
    blocks: tuple[BlockSnapshot, ...]
    expandable: bool = False

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.state is BlockState.ALLOCATED)


class TraceAction(enum.Enum):
    """What a trace event records."""

    ALLOC = "alloc"
    FREE = "free"  # the caller freed a block (it may still wait for events)
    FREE_COMPLETED = "free_completed"  # a waiting block's events completed; it is reusable now
    SEGMENT_ALLOC = "segment_alloc"
    SEGMENT_FREE = "segment_free"
    OOM = "oom"


_TRACE_ACTIONS = (
    TraceAction.ALLOC,
    TraceAction.FREE,
    TraceAction.FREE_COMPLETED,
    TraceAction.SEGMENT_ALLOC,
    TraceAction.SEGMENT_FREE,
    TraceAction.OOM,
)


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One allocator event, numbered in order (``seq``), with the byte totals right after it."""

    seq: int
    action: TraceAction
    address: int
    size: int
    stream: int
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int


RawBlock = tuple[int, int, int, int, "list[tuple[str, str, int]] | None"]
RawSegment = tuple[int, int, int, bool, bool, list[RawBlock]]
RawTraceEntry = tuple[int, int, int, int, int, int, int, int]


def segments_from_raw(raw: list[RawSegment]) -> list[SegmentSnapshot]:
    """Turns the core's tuples into snapshots."""
    segments = []
    for address, size, stream, small, expandable, blocks in raw:
        segments.append(
            SegmentSnapshot(
                address=address,
                size=size,
                stream=stream,
                pool="small" if small else "large",
                blocks=tuple(
                    BlockSnapshot(
                        address=b_address,
                        size=b_size,
                        requested_size=requested,
                        state=_BLOCK_STATES[state],
                        stack=None if stack is None else tuple(StackFrame(*frame) for frame in stack),
                    )
                    for b_address, b_size, requested, state, stack in blocks
                ),
                expandable=expandable,
            )
        )
    return segments


def trace_from_raw(raw: list[RawTraceEntry]) -> list[TraceEvent]:
    """Turns the core's tuples into trace events."""
    return [
        TraceEvent(seq, _TRACE_ACTIONS[action], address, size, stream, allocated, reserved, active)
        for seq, action, address, size, stream, allocated, reserved, active in raw
    ]
