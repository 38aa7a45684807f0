"""``blutrain memory-plot SNAPSHOT``: pictures of a snapshot file that the allocator wrote (a GPU run's
``save_snapshot``), drawn wherever the file is — no GPU needed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blutrain.tensor.errors import BluTrainError


class MemoryPlotError(BluTrainError):
    """The snapshot file could not be read or drawn."""


def add_command(sub: Any) -> None:
    p = sub.add_parser("memory-plot", help="draw an allocator snapshot file: segments by block state, and "
                                           "allocated/reserved bytes over the recorded events")
    p.add_argument("snapshot", type=Path, help="a JSON file written by blutrain.alloc.save_snapshot")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the PNGs (default: beside the snapshot, named after it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: every other blutrain command must work where blutrain-alloc's native
    # core is not built (a source tree on PYTHONPATH).
    from blutrain.alloc import AllocatorError, format_bytes, load_snapshot, plot_snapshot, plot_timeline

    source: Path = args.snapshot
    out: Path = args.out if args.out is not None else source.parent
    out.mkdir(parents=True, exist_ok=True)
    try:
        loaded = load_snapshot(source)
        segments_png = out / f"{source.stem}_segments.png"
        plot_snapshot(loaded.segments, segments_png)
        written = [segments_png]
        if loaded.trace:
            timeline_png = out / f"{source.stem}_timeline.png"
            plot_timeline(loaded.trace, timeline_png)
            written.append(timeline_png)
    except AllocatorError as exc:
        raise MemoryPlotError(str(exc)) from exc
    reserved = sum(s.size for s in loaded.segments)
    allocated = sum(s.allocated_bytes for s in loaded.segments)
    print(f"{len(loaded.segments)} segments, {format_bytes(reserved)} reserved, {format_bytes(allocated)} allocated"
          f", {len(loaded.trace)} trace events")
    if loaded.stats is not None:
        s = loaded.stats
        print(f"peak allocated {format_bytes(s.allocated_bytes_peak)}, peak reserved "
              f"{format_bytes(s.reserved_bytes_peak)}, fragmentation {format_bytes(s.fragmentation_bytes)}, "
              "largest free block "
              f"{format_bytes(s.largest_free_block)}")
    for path in written:
        print(f"wrote {path}")
    return 0
