"""PNG pictures of allocator memory: a snapshot's segments and a trace's byte totals over time.

matplotlib is imported when a picture is drawn (``pip install 'blutrain-alloc[plot]'``); drawing uses
matplotlib's object API with the Agg canvas, so it never touches pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from typing import Any

from blutrain.alloc.errors import AllocatorError
from blutrain.alloc.snapshot import BlockState, SegmentSnapshot, TraceAction, TraceEvent
from blutrain.alloc.units import format_bytes

__all__ = ["plot_snapshot", "plot_timeline"]

_MIB = float(1 << 20)
_STATE_COLOURS = {
    BlockState.ALLOCATED: "#1f77b4",
    BlockState.FREE: "#d9d9d9",
    BlockState.PENDING_EVENT: "#ff7f0e",
}


def _new_figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise AllocatorError(
            f"blutrain.alloc.plot needs matplotlib ({exc});"
            " install it with pip install 'blutrain-alloc[plot]'"
        ) from exc
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def plot_snapshot(snapshot: Sequence[SegmentSnapshot], path: str | PathLike[str]) -> None:
    """Draws each segment as a horizontal bar (offset in MiB on x) with its blocks coloured by state:
    allocated blue, free grey, waiting for stream events orange; writes a PNG to ``path``."""
    from matplotlib.patches import Patch

    segments = list(snapshot)
    figure = _new_figure(10.0, max(2.5, 0.45 * len(segments) + 1.5))
    axes = figure.add_subplot(1, 1, 1)
    for row, segment in enumerate(segments):
        for block in segment.blocks:
            axes.barh(
                row,
                block.size / _MIB,
                left=(block.address - segment.address) / _MIB,
                height=0.7,
                color=_STATE_COLOURS[block.state],
                edgecolor="white",
                linewidth=0.5,
            )
    axes.set_yticks(range(len(segments)))
    axes.set_yticklabels(
        [
            f"{s.address:#x} {s.pool}{' expandable' if s.expandable else ''} s{s.stream} ({format_bytes(s.size)})"
            for s in segments
        ], fontsize=7
    )
    axes.invert_yaxis()
    axes.set_xlabel("offset in segment (MiB)")
    allocated = sum(s.allocated_bytes for s in segments)
    reserved = sum(s.size for s in segments)
    axes.set_title(
        f"{len(segments)} segments: {format_bytes(allocated)} allocated of {format_bytes(reserved)} reserved"
    )
    shown = {block.state for segment in segments for block in segment.blocks}
    axes.legend(
        handles=[
            Patch(color=colour, label=state.value)
            for state, colour in _STATE_COLOURS.items()
            if state in shown
        ],
        loc="lower right",
        fontsize=7,
    )
    figure.tight_layout()
    figure.savefig(path, format="png")


def plot_timeline(events: Sequence[TraceEvent], path: str | PathLike[str]) -> None:
    """Draws allocated, active and reserved bytes after each trace event (x: event number), marking
    out-of-memory events in red; writes a PNG to ``path``."""
    trace = list(events)
    figure = _new_figure(10.0, 4.0)
    axes = figure.add_subplot(1, 1, 1)
    seqs = [e.seq for e in trace]
    for label, values, colour in (
        ("reserved", [e.reserved_bytes / _MIB for e in trace], "#2ca02c"),
        ("active", [e.active_bytes / _MIB for e in trace], "#ff7f0e"),
        ("allocated", [e.allocated_bytes / _MIB for e in trace], "#1f77b4"),
    ):
        axes.step(seqs, values, where="post", label=label, color=colour)
    ooms = [e for e in trace if e.action is TraceAction.OOM]
    if ooms:
        axes.scatter(
            [e.seq for e in ooms],
            [e.reserved_bytes / _MIB for e in ooms],
            color="red",
            marker="x",
            label="OOM",
        )
    axes.set_xlabel("allocator event")
    axes.set_ylabel("MiB")
    axes.set_title(f"{len(trace)} allocator events")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, format="png")
