"""Snapshot files: what save_snapshot writes, load_snapshot gives back whole, and bad files are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from blutrain.alloc import AllocatorError, CachingAllocator, HostProvider, load_snapshot, save_snapshot

MiB = 1 << 20


def test_round_trip_keeps_segments_blocks_stacks_trace_and_stats(tmp_path: Path) -> None:
    allocator = CachingAllocator(HostProvider(), record_stacks=True, trace_capacity=64)
    a = allocator.malloc(1000, stream=3)
    b = allocator.malloc(5 * MiB)
    allocator.free(a)
    segments = allocator.memory_snapshot(include_stacks=True)
    trace = allocator.trace()
    stats = allocator.stats()
    path = save_snapshot(tmp_path / "snap.json", segments, trace, stats)
    loaded = load_snapshot(path)
    assert list(loaded.segments) == segments
    assert list(loaded.trace) == trace
    assert loaded.stats == stats
    assert any(blk.stack for s in loaded.segments for blk in s.blocks)
    allocator.free(b)


def test_segments_alone_load_with_empty_trace_and_no_stats(tmp_path: Path) -> None:
    allocator = CachingAllocator(HostProvider())
    allocator.malloc(2048)
    loaded = load_snapshot(save_snapshot(tmp_path / "s.json", allocator.memory_snapshot()))
    assert loaded.trace == () and loaded.stats is None and len(loaded.segments) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "cannot read"),
        ('{"format": "other"}', "format tag"),
        ('{"format": "blutrain-alloc-snapshot", "version": 99}', "version 1, got 99"),
        ('{"format": "blutrain-alloc-snapshot", "version": 1, "segments": [{"size": 1}]}', "damaged"),
    ],
)
def test_bad_files_are_refused_naming_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(AllocatorError, match=message):
        load_snapshot(path)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AllocatorError, match="cannot read"):
        load_snapshot(tmp_path / "absent.json")
