"""Per-op dispatch overhead on the CPU: µs per ``a + b`` in BluTrain against plain NumPy.

On small tensors the arithmetic is nearly free, so the time per op is the framework's host
overhead: argument checks, dtype promotion, the (op, device, dtype) kernel lookup, wrapping the
result, and, when an input requires grad, recording the autograd node. Each case is timed in
batches of calls; the table shows the median over batches (and the spread), so a stray scheduler
hiccup does not move it. Results are printed as a table and written as JSON.

    uv run --no-sync python tools/bench_dispatch.py [--out tools/results/bench_dispatch.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import blutrain.tensor as bt

SHAPES: dict[str, tuple[int, ...]] = {"4": (4,), "64x64": (64, 64)}


def _cases(shape: tuple[int, ...]) -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(0)
    na, nb = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    a, b = bt.from_numpy(na.copy()), bt.from_numpy(nb.copy())
    ga, gb = bt.tensor(na, requires_grad=True), bt.tensor(nb, requires_grad=True)
    return {
        "numpy a + b": lambda: na + nb,
        "blutrain a + b": lambda: a + b,
        "blutrain a + b (requires_grad, recorded)": lambda: ga + gb,
        "numpy a * 2.0": lambda: na * 2.0,
        "blutrain a * 2.0": lambda: a * 2.0,
    }


def time_call(fn: Callable[[], Any], calls: int, batches: int) -> dict[str, float]:
    """Median, min and max µs per call over ``batches`` batches of ``calls`` calls (after a warm-up)."""
    for _ in range(calls):
        fn()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "max_us": max(per_call)}


def run(calls: int, batches: int) -> list[dict[str, Any]]:
    rows = []
    for shape_name, shape in SHAPES.items():
        for case, fn in _cases(shape).items():
            rows.append({"shape": shape_name, "case": case, **time_call(fn, calls, batches)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':<7} {'case':<42} {'median µs':>10} {'min':>8} {'max':>8} {'× numpy':>8}"]
    for r in rows:
        base = next(x["median_us"] for x in rows if x["shape"] == r["shape"] and x["case"].startswith("numpy")
                    and x["case"].split(" ", 1)[1] == r["case"].split(" ", 1)[1].replace(
                        " (requires_grad, recorded)", ""))
        lines.append(f"{r['shape']:<7} {r['case']:<42} {r['median_us']:>10.2f} {r['min_us']:>8.2f} "
                     f"{r['max_us']:>8.2f} {r['median_us'] / base:>8.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_dispatch.json")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    parser.add_argument("--batches", type=int, default=31, help="timed batches per case (median reported)")
    args = parser.parse_args()
    rows = run(args.calls, args.batches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
            "processor": platform.processor(), "calls_per_batch": args.calls, "batches": args.batches}
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(table(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
