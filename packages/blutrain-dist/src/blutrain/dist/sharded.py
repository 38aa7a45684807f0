"""Sharded state: what one rank holds of a model and its optimizer, and the merge back to full state.

A :class:`StateShard` holds, for each tensor of a model's state (dotted names as in ``state_dict``),
one range of its flattened elements, and the same range of each of the optimizer's per-parameter state
tensors. A range is ``(start, stop)``: the elements ``[start, stop)`` (ZeRO's flat buckets), optionally
followed by ``(step, count)`` pairs, outermost first, each repeating the block ``count`` times ``step``
elements apart: tensor parallelism's column block of a (768, 3072) weight on rank 1 of 4 is
``(768, 1536, 3072, 768)``, 768 rows of 768 elements, one row of the full weight apart. The piece holds
the blocks' elements in that order (the outermost repeat slowest), which is the rank's own tensor
flattened. Ranges say nothing about how the ranks were laid out, so shards saved by one layout (ZeRO
on 2 ranks, tp = 2) merge into full state that any other layout (4 ranks, a single process) slices
again: :func:`merge_shards`.

A shard may hold only part of its range's piece: ``windows[name] = (lo, hi)`` says it holds elements
``[lo, hi)`` of that piece (nested shards: ZeRO's flat shard of a tensor-parallel block, whose piece is
the block flattened). Layouts with windows are written in format ``blutrain-sharded-2``, which a reader
that knows no windows refuses instead of misreading; both formats are read.

In a shard's optimizer state a tensor that is 1-D with the range's length is a piece of a tensor of
the parameter's shape (Adam's moments); every other value (a step count) is the same on every rank
holding part of that parameter and is taken from any of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blutrain.tensor import Tensor, from_numpy

from blutrain.dist.errors import DistArgumentError

FORMAT = "blutrain-sharded-1"
FORMAT_NESTED = "blutrain-sharded-2"  # a layout with windows (nested shards)
FORMATS = (FORMAT, FORMAT_NESTED)

Range = tuple[int, ...]  # (start, stop) then (step, count) pairs, outermost first; see the module doc
Window = tuple[int, int]  # (lo, hi): the elements [lo, hi) of a range's piece; see the module doc


def range_length(r: Range) -> int:
    """How many elements the range ``r`` holds (the length of its 1-D piece)."""
    return (r[1] - r[0]) * math.prod(r[3::2])


def range_blocks(r: Range) -> list[tuple[int, int]]:
    """The contiguous blocks ``[start, stop)`` of ``r``, in the order its piece holds them."""
    starts = [r[0]]
    for step, count in zip(r[2::2], r[3::2], strict=True):
        starts = [s + j * step for s in starts for j in range(count)]
    return [(s, s + r[1] - r[0]) for s in starts]


def piece_blocks(r: Range, window: Window | None = None) -> list[tuple[int, int]]:
    """The contiguous blocks ``[start, stop)`` of the flattened full tensor that the piece of ``r`` holds, cut to
    ``window`` (elements ``[lo, hi)`` of the piece; None: all of it), in the order the piece holds them."""
    blocks = range_blocks(r)
    if window is None:
        return blocks
    lo, hi = window
    out, at = [], 0
    for start, stop in blocks:
        a, b = max(lo - at, 0), min(hi - at, stop - start)
        if a < b:
            out.append((start + a, start + b))
        at += stop - start
    return out


def piece_length(r: Range, window: Window | None = None) -> int:
    """How many elements a shard holds of range ``r`` cut to ``window``."""
    return range_length(r) if window is None else window[1] - window[0]


@dataclass
class StateShard:
    """One rank's part of a model's and its optimizer's state.

    ``shapes``: every tensor of the whole model state (all ranks), name → full shape. ``ranges`` and
    ``params``: the range this shard holds of a flattened tensor (:data:`Range`), and those elements
    (1-D, :func:`range_length` of them). ``optimizer``:
    name → that parameter's optimizer state restricted to the same range. ``param_groups``: the
    optimizer's groups, hyperparameters and ``"params"`` as names, in the optimizer's order.
    """

    shapes: dict[str, tuple[int, ...]]
    ranges: dict[str, Range] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    windows: dict[str, Window] = field(default_factory=dict)

    def length(self, name: str) -> int:
        """How many elements this shard holds of ``name`` (the length of its 1-D piece)."""
        return piece_length(self.ranges[name], self.windows.get(name))

    def layout(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON-ready values (the index a checkpoint stores)."""
        out = {"format": FORMAT_NESTED if self.windows else FORMAT,
               "shapes": {n: list(s) for n, s in self.shapes.items()},
               "ranges": {n: list(r) for n, r in self.ranges.items()}, "param_groups": self.param_groups}
        if self.windows:
            out["windows"] = {n: list(w) for n, w in self.windows.items()}
        return out

    @classmethod
    def from_layout(cls, layout: Any, params: dict[str, Tensor], optimizer: dict[str, dict[str, Any]],
                    where: str = "shard") -> StateShard:
        """The inverse of :meth:`layout` plus the tensors; every range and piece is checked."""
        if not isinstance(layout, dict) or layout.get("format") not in FORMATS:
            got = layout.get("format") if isinstance(layout, dict) else type(layout).__name__
            raise DistArgumentError(f"{where}: expected a sharded-state layout of format "
                                    f"{' or '.join(map(repr, FORMATS))}, got {got!r}")
        try:
            shapes = {str(n): tuple(int(d) for d in s) for n, s in layout["shapes"].items()}
            ranges = {str(n): tuple(int(v) for v in r) for n, r in layout["ranges"].items()}
            groups = list(layout["param_groups"])
            windows: dict[str, Window] = {}
            for n, w in dict(layout.get("windows", {})).items():
                lo, hi = (int(v) for v in w)
                windows[str(n)] = (lo, hi)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise DistArgumentError(f"{where}: malformed sharded-state layout ({type(exc).__name__}: {exc})") from None
        shard = cls(shapes, ranges, dict(params), {str(k): dict(v) for k, v in optimizer.items()}, groups, windows)
        shard.check(where)
        return shard

    def check(self, where: str = "shard") -> None:
        for name, r in self.ranges.items():
            if name not in self.shapes:
                raise DistArgumentError(f"{where}: range of {name!r}, which has no shape")
            n = math.prod(self.shapes[name])
            if len(r) < 2 or len(r) % 2 or any(v < 1 for v in r[2:]):
                raise DistArgumentError(f"{where}: range {list(r)} of {name!r} must be [start, stop] followed by "
                                        "[step, count] pairs of positive ints")
            start, stop = r[0], r[1]
            last = start + sum(step * (count - 1) for step, count in zip(r[2::2], r[3::2], strict=True))
            if not 0 <= start < stop <= n or last + stop - start > n:
                raise DistArgumentError(f"{where}: range {list(r)} of {name!r} is not inside its {n} elements")
            window = self.windows.get(name)
            if window is not None and not 0 <= window[0] < window[1] <= range_length(r):
                raise DistArgumentError(f"{where}: window {list(window)} of {name!r} is not inside the "
                                        f"{range_length(r)} elements of its range {list(r)}")
            piece = self.params.get(name)
            length = piece_length(r, window)
            if piece is None or tuple(piece.shape) != (length,):
                got = list(piece.shape) if piece is not None else "nothing"
                raise DistArgumentError(f"{where}: {name!r} must hold a 1-D piece of {length} elements for "
                                        f"its range {list(r)}, got {got}")
        if not set(self.windows) <= set(self.ranges):
            raise DistArgumentError(f"{where}: windows without ranges: {sorted(set(self.windows) - set(self.ranges))}")
        if set(self.params) != set(self.ranges):
            raise DistArgumentError(f"{where}: pieces without ranges: {sorted(set(self.params) ^ set(self.ranges))}")


def _numpy(t: Tensor) -> np.ndarray[Any, Any]:
    return np.asarray(t.detach().to(device="cpu").numpy())


def _join(name: str, key: str, shape: tuple[int, ...],
          pieces: list[tuple[Range, Window | None, Tensor]]) -> Tensor:
    n = math.prod(shape)
    blocks: list[tuple[int, int, np.ndarray[Any, Any]]] = []
    for r, window, piece in pieces:
        flat, at = _numpy(piece).reshape(-1), 0
        for start, stop in piece_blocks(r, window):
            blocks.append((start, stop, flat[at:at + stop - start]))
            at += stop - start
    blocks.sort(key=lambda x: x[0])
    at = 0
    for start, stop, _ in blocks:
        if start != at:
            what = "overlap" if start < at else "a gap"
            raise DistArgumentError(f"merge_shards: the shards of {name!r}{key} have {what} at element {at} "
                                    f"(a piece starts at {start}); every element must be held exactly once")
        at = stop
    if at != n:
        raise DistArgumentError(f"merge_shards: the shards hold elements [0, {at}) of {name!r}{key}, which has {n}; "
                                "a shard file is missing")
    flat = np.concatenate([b for _, _, b in blocks]) if blocks else np.zeros(0, dtype=np.float32)
    return from_numpy(np.ascontiguousarray(flat.reshape(shape)))


def merge_shards(shards: Sequence[StateShard]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Full state from shards that together hold every element once: ``(model_state, optimizer_state)``.

    ``model_state`` maps each name to a CPU tensor of its full shape; ``optimizer_state`` is in
    :meth:`blutrain.optim.Optimizer.state_dict`'s format (parameters numbered in the order of the
    groups), so ``optimizer.load_state_dict`` of an optimizer built the same way takes it.
    """
    if not shards:
        raise DistArgumentError("merge_shards: got no shards")
    shapes = shards[0].shapes
    for i, s in enumerate(shards):
        if s.shapes != shapes:
            raise DistArgumentError(f"merge_shards: shard {i} describes other tensors than shard 0 (different "
                                    "models)")
    model = {}
    for name, shape in shapes.items():
        held = [(s.ranges[name], s.windows.get(name), s.params[name]) for s in shards if name in s.ranges]
        model[name] = _join(name, "", shape, held)
    groups = shards[0].param_groups
    order = [name for g in groups for name in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(order):
        if name not in shapes:
            raise DistArgumentError(f"merge_shards: the optimizer's parameter {name!r} is not a tensor of the model")
        holders = [s for s in shards if name in s.optimizer]
        if not holders:
            continue
        entry: dict[str, Any] = {}
        for key, value in holders[0].optimizer[name].items():
            if isinstance(value, Tensor) and tuple(value.shape) == (holders[0].length(name),):
                pieces = [(s.ranges[name], s.windows.get(name), s.optimizer[name][key]) for s in holders]
                entry[key] = _join(name, f" (optimizer state {key!r})", shapes[name], pieces)
            else:
                entry[key] = value
        state[index] = entry
    numbered = [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [order.index(n) for n in g["params"]]} for g in groups]
    return model, {"state": state, "param_groups": numbered}


__all__ = ["FORMAT", "FORMATS", "FORMAT_NESTED", "Range", "StateShard", "Window", "merge_shards", "piece_blocks",
           "piece_length", "range_blocks", "range_length"]
