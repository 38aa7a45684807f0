"""Shared by the compiled-parallel workers (compiled_dp.py, compiled_tp_cp.py): what a compiled training run
reports, its comparison with the eager run of the same configuration, and rank 0's results file. A worker
runs as a script, so this module is found beside it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt


def compiled_stats(fn: Any) -> dict[str, Any]:
    """Traces, the collectives the compiled function's last graph issues (all inside its one program), and on
    CUDA whether the step ran as one captured graph (no fallback to launching its list one by one)."""
    executor = fn.last.executor
    captured = bool(getattr(executor, "captures", 0)) and not getattr(executor, "eager", True)
    return {"traces": fn.traces, "collectives": fn.stats.collectives, "captured": captured,
            "capture_error": getattr(executor, "capture_error", None), "recomputed": fn.stats.recomputed,
            "collectives_in_backward": collectives_in_backward(fn)}


def collectives_in_backward(fn: Any) -> int:
    """The collectives the last graph issues between its first backward kernel and its last one (the gradient
    reductions that run beside the rest of backward; those issued after it run beside nothing of it)."""
    launches = fn.last.program.launches
    backward = [i for i, launch in enumerate(launches) if "backward" in getattr(launch.fn, "__name__", "")]
    if not backward:
        return 0
    return sum(1 for i in range(backward[0], backward[-1]) if launches[i].kind == "collective")


def versus(group: dist.ProcessGroup, eager: dict[str, Any], compiled: dict[str, Any],
           pairs: Iterable[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]], device: str = "cpu") -> dict[str, Any]:
    """The compiled run beside the eager one: their losses and norms, the compiled run's stats, and the
    largest parameter difference over ``pairs`` (eager, compiled) of every rank (the group's max)."""
    mine = max((float(np.abs(a - b).max()) for a, b in pairs), default=0.0)
    diff = bt.tensor([mine], device=device)
    group.all_reduce(diff, op="max")
    return {"eager": {k: eager[k] for k in ("losses", "norms")},
            "compiled": {k: v for k, v in compiled.items() if k != "params"}, "param_diff": float(diff.item())}


def finish(group: dist.ProcessGroup, results: dict[str, Any], path: str) -> int:
    """Rank 0 writes ``results`` as JSON to ``path``; every rank leaves the group."""
    if group.rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0
