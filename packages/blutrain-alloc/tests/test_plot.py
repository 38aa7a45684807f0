"""PNG pictures of snapshots and traces (needs matplotlib; skipped without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from blutrain.alloc import CachingAllocator, HostProvider, OutOfMemoryError, plot_snapshot, plot_timeline

matplotlib_image = pytest.importorskip("matplotlib.image")

MiB = 1 << 20


def colour_present(path: Path, hex_colour: str) -> bool:
    pixels = matplotlib_image.imread(str(path))[:, :, :3]
    target = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    close = abs(pixels - target).max(axis=2) < 0.02
    return bool(close.sum() >= 20)


def test_snapshot_picture_shows_allocated_free_and_pending_blocks_in_their_colours(tmp_path: Path) -> None:
    allocator = CachingAllocator(HostProvider())
    ptrs = [allocator.malloc(256 << 10) for _ in range(4)]
    allocator.record_stream(ptrs[1], 1)
    allocator.free(ptrs[1])  # pending
    allocator.free(ptrs[2])  # free
    allocator.malloc(3 * MiB)
    path = tmp_path / "snapshot.png"
    plot_snapshot(allocator.memory_snapshot(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for colour in ("#1f77b4", "#d9d9d9", "#ff7f0e"):
        assert colour_present(path, colour), colour


def test_snapshot_picture_has_no_pending_colour_when_no_block_waits(tmp_path: Path) -> None:
    allocator = CachingAllocator(HostProvider())
    allocator.free(allocator.malloc(1000))
    allocator.malloc(5000)
    path = tmp_path / "snapshot.png"
    plot_snapshot(allocator.memory_snapshot(), path)
    assert colour_present(path, "#1f77b4")
    assert not colour_present(path, "#ff7f0e")


def test_timeline_picture_shows_the_byte_totals_and_marks_out_of_memory(tmp_path: Path) -> None:
    allocator = CachingAllocator(HostProvider(limit=24 * MiB), trace_capacity=100)
    ptrs = [allocator.malloc(s) for s in (1000, 3 * MiB, 12 * MiB)]
    allocator.free(ptrs[1])
    with pytest.raises(OutOfMemoryError):
        allocator.malloc(20 * MiB)
    path = tmp_path / "timeline.png"
    plot_timeline(allocator.trace(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for colour in ("#2ca02c", "#1f77b4", "#ff0000"):
        assert colour_present(path, colour), colour
