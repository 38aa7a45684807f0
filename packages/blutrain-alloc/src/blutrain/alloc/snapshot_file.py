"""Snapshot files: a memory snapshot, the event trace and the statistics in one JSON document, so that a
picture can be drawn later and elsewhere (``blutrain memory-plot FILE``) from what a GPU run wrote."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any

from blutrain.alloc.errors import AllocatorError
from blutrain.alloc.snapshot import (
    BlockSnapshot,
    BlockState,
    SegmentSnapshot,
    StackFrame,
    TraceAction,
    TraceEvent,
)
from blutrain.alloc.stats import AllocatorStats

__all__ = ["SnapshotFile", "load_snapshot", "save_snapshot"]

FORMAT = "blutrain-alloc-snapshot"
VERSION = 1


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    """What a snapshot file holds; ``trace`` is empty and ``stats`` None when they were not saved."""

    segments: tuple[SegmentSnapshot, ...]
    trace: tuple[TraceEvent, ...]
    stats: AllocatorStats | None


def _segment_to_json(segment: SegmentSnapshot) -> dict[str, Any]:
    return {
        "address": segment.address,
        "size": segment.size,
        "stream": segment.stream,
        "pool": segment.pool,
        "expandable": segment.expandable,
        "blocks": [
            {
                "address": b.address,
                "size": b.size,
                "requested_size": b.requested_size,
                "state": b.state.value,
                "stack": None if b.stack is None else [[f.filename, f.name, f.line] for f in b.stack],
            }
            for b in segment.blocks
        ],
    }


def _stack_from_json(raw: list[list[Any]] | None) -> tuple[StackFrame, ...] | None:
    return None if raw is None else tuple(StackFrame(str(f), str(n), int(i)) for f, n, i in raw)


def _segment_from_json(raw: dict[str, Any]) -> SegmentSnapshot:
    return SegmentSnapshot(
        address=int(raw["address"]),
        size=int(raw["size"]),
        stream=int(raw["stream"]),
        pool=str(raw["pool"]),
        blocks=tuple(
            BlockSnapshot(
                address=int(b["address"]),
                size=int(b["size"]),
                requested_size=int(b["requested_size"]),
                state=BlockState(b["state"]),
                stack=_stack_from_json(b["stack"]),
            )
            for b in raw["blocks"]
        ),
        expandable=bool(raw.get("expandable", False)),  # absent in files written before it existed
    )


def save_snapshot(
    path: str | PathLike[str],
    segments: Sequence[SegmentSnapshot],
    trace: Sequence[TraceEvent] = (),
    stats: AllocatorStats | None = None,
) -> Path:
    """Writes ``segments`` (``memory_snapshot()``), ``trace`` (``trace()``) and ``stats`` as JSON."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "segments": [_segment_to_json(s) for s in segments],
        "trace": [[e.seq, e.action.value, e.address, e.size, e.stream, e.allocated_bytes, e.reserved_bytes,
                   e.active_bytes] for e in trace],
        "stats": None if stats is None else asdict(stats),
    }
    target = Path(path)
    target.write_text(json.dumps(document))
    return target


def load_snapshot(path: str | PathLike[str]) -> SnapshotFile:
    """Reads a file written by ``save_snapshot``; a file of another kind raises AllocatorError saying so."""
    source = Path(path)
    try:
        document = json.loads(source.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AllocatorError(f"load_snapshot(path): cannot read {str(source)!r} as a snapshot file: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise AllocatorError(
            f"load_snapshot(path): expected a {FORMAT!r} JSON document, got {str(source)!r} without that format tag"
        )
    if document.get("version") != VERSION:
        raise AllocatorError(
            f"load_snapshot(path): expected snapshot format version {VERSION}, got {document.get('version')!r}"
        )
    try:
        segments = tuple(_segment_from_json(s) for s in document["segments"])
        trace = tuple(
            TraceEvent(int(seq), TraceAction(action), int(a), int(s), int(st), int(al), int(re), int(ac))
            for seq, action, a, s, st, al, re, ac in document["trace"]
        )
        raw_stats = document["stats"]
        names = {f.name for f in fields(AllocatorStats)}
        stats = None if raw_stats is None else AllocatorStats(**{k: int(v) for k, v in raw_stats.items() if k in names})
    except (KeyError, TypeError, ValueError) as exc:
        raise AllocatorError(f"load_snapshot(path): {str(source)!r} is a damaged snapshot file: {exc!r}") from exc
    return SnapshotFile(segments, trace, stats)
