"""``blutrain memory-plot``: draws a snapshot file written by the allocator; refuses a bad one clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from blutrain.alloc import CachingAllocator, HostProvider, save_snapshot
from blutrain.cli import main

MiB = 1 << 20


def test_draws_segments_and_timeline_from_a_snapshot_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    allocator = CachingAllocator(HostProvider(), trace_capacity=64)
    blocks = [allocator.malloc(n) for n in (1000, 3 * MiB, 12 * MiB)]
    allocator.free(blocks[1])
    snap = save_snapshot(tmp_path / "step.json", allocator.memory_snapshot(), allocator.trace(), allocator.stats())
    assert main(["memory-plot", str(snap), "--out", str(tmp_path / "png")]) == 0
    for name in ("step_segments.png", "step_timeline.png"):
        png = tmp_path / "png" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "2 segments, 22.00 MiB reserved" in out and "peak reserved" in out


def test_a_file_that_is_not_a_snapshot_fails_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "metrics.json"
    bad.write_text('{"loss": 1.0}')
    assert main(["memory-plot", str(bad)]) == 1
    assert "blutrain-alloc-snapshot" in capsys.readouterr().err
