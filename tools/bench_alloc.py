"""blutrain-alloc on the GPU: allocation cost against CuPy's pool and PyTorch's caching allocator, and
one GPT-2 training step traced into a snapshot file and pictures.

    python tools/bench_alloc.py [--out DIR] [--steps 3] [--batch-size 16] [--seq-len 1024] [--no-gpt2]
    python tools/bench_alloc.py --expandable    # part 2 only, with expandable segments (BLUTRAIN_ALLOC_CONF)

1. Cost: the same size mix (log-uniform 512 B .. 64 MiB, seed 0; 4,000 requests with up to 64 live,
   freed in random order) replayed after a warm-up through
   - blutrain-alloc's native core alone (``CachingAllocator.malloc``/``free``, integers only),
   - CuPy with blutrain-alloc installed (``cupy.empty`` + drop: the per-array path the backend uses),
   - CuPy with its own MemoryPool (``cupy.empty`` + drop),
   - PyTorch (``torch.empty`` + drop, its caching allocator).
   Reported as µs per alloc+free pair (host time; no kernel runs).
2. Memory: GPT-2 (gpt2-124m by default) trained ``--steps`` steps on random tokens with the backend's
   allocator, the last step recorded (events and stacks); prints peak allocated/reserved, fragmentation
   and the largest free block, writes ``gpt2_step_snapshot.json`` and draws it (``blutrain memory-plot``).
   PyTorch's side of the memory comparison is tools/bench/gpt2.py's job (same model, same run).

Writes bench_alloc.json (bench_alloc_expandable.json with --expandable) under --out (default $OUT or
tools/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20


def size_mix(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Request sizes and, for each step, which live slot to free next (-1: none yet)."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(512), np.log(64 * MiB), n)).astype(np.int64)
    order = rng.integers(0, 1 << 30, n)
    return [int(s) for s in sizes], [int(o) for o in order]


def replay(alloc: Callable[[int], Any], free: Callable[[Any], None], sizes: list[int], order: list[int],
           live_max: int = 64) -> float:
    """Runs the mix; returns µs per alloc+free pair."""
    live: list[Any] = []
    t0 = time.perf_counter()
    for size, pick in zip(sizes, order, strict=True):
        live.append(alloc(size))
        if len(live) >= live_max:
            free(live.pop(pick % len(live)))
    while live:
        free(live.pop())
    return (time.perf_counter() - t0) / len(sizes) * 1e6


def bench_cost(repeats: int) -> dict[str, float]:
    import cupy as cp
    import torch

    from blutrain.alloc import CachingAllocator
    from blutrain.alloc import cupy as alloc_cupy

    sizes, order = size_mix(4000)
    results: dict[str, list[float]] = {}

    def run(name: str, alloc: Callable[[int], Any], free: Callable[[Any], None]) -> None:
        replay(alloc, free, sizes, order)  # warm-up fills the cache
        results[name] = [replay(alloc, free, sizes, order) for _ in range(repeats)]

    core = CachingAllocator(alloc_cupy.CupyDeviceProvider(0))
    run("blutrain-alloc core (malloc/free)", lambda n: core.malloc(n, 0), core.free)
    core.empty_cache()

    previous = cp.cuda.memory.get_allocator()
    hook = alloc_cupy.install()
    run("cupy.empty via blutrain-alloc", lambda n: cp.empty(n, cp.uint8), lambda a: None)
    hook.empty_cache()
    pool = cp.cuda.MemoryPool()
    cp.cuda.set_allocator(pool.malloc)
    run("cupy.empty via CuPy MemoryPool", lambda n: cp.empty(n, cp.uint8), lambda a: None)
    pool.free_all_blocks()
    cp.cuda.set_allocator(previous)
    run("torch.empty (caching allocator)", lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"),
        lambda a: None)
    torch.cuda.empty_cache()
    return {k: statistics.median(v) for k, v in results.items()}


def bench_gpt2_memory(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import blutrain.tensor as bt
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.optim import create, weight_decay_groups
    from blutrain_backend_cupy import cuda

    if cuda.allocator_name() != "blutrain":
        raise SystemExit(f"the GPT-2 memory part needs BluTrain's allocator; {cuda.allocator_name()!r} is chosen")
    bt.manual_seed(0)
    model = GPT2(GPT2Config.preset(args.preset)).to("cuda")
    opt = create("adamw", weight_decay_groups(model.parameters(), 0.1), lr=3e-4, betas=(0.9, 0.95))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    per_step = []
    for step in range(args.steps):
        last = step == args.steps - 1
        if last:
            cuda.synchronize()
            cuda.reset_peak_memory_stats()
            cuda.record_memory_history(True, trace_capacity=200_000, stacks=True)
        tokens = rng.integers(0, min(vocab, 50257), size=(args.batch_size, args.seq_len + 1), dtype=np.int64)
        x = bt.from_numpy(tokens[:, :-1].copy()).to("cuda")
        y = bt.from_numpy(tokens[:, 1:].copy()).to("cuda")
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _, loss = model(x, y, return_logits=False)
        loss.backward()
        opt.step()
        cuda.synchronize()
        per_step.append({"step": step, "loss": float(loss.item()), "seconds": time.perf_counter() - t0})
    stats = cuda.memory_stats()
    snapshot = cuda.save_memory_snapshot(out / f"gpt2_step_snapshot{'_expandable' if args.expandable else ''}.json")
    cuda.record_memory_history(False)
    from blutrain.cli import main as cli_main

    cli_main(["memory-plot", str(snapshot), "--out", str(out)])
    frag = stats.reserved_bytes - stats.allocated_bytes
    return {
        "preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": per_step,
        "peak_allocated_bytes": stats.allocated_bytes_peak, "peak_reserved_bytes": stats.reserved_bytes_peak,
        "reserved_bytes_end": stats.reserved_bytes, "allocated_bytes_end": stats.allocated_bytes,
        "fragmentation_bytes_end": frag, "fragmentation_of_peak_reserved": (
            (stats.reserved_bytes_peak - stats.allocated_bytes_peak) / max(stats.reserved_bytes_peak, 1)),
        "largest_free_block": stats.largest_free_block, "segments": stats.segment_count,
        "oom_retries": stats.oom_retries, "cache_hits": stats.cache_hits, "alloc_count": stats.alloc_count,
        "snapshot": str(snapshot),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "tools/results")))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--no-gpt2", action="store_true", help="only the allocation-cost part")
    ap.add_argument("--expandable", action="store_true",
                    help="only the GPT-2 part, with expandable segments (sets BLUTRAIN_ALLOC_CONF for this process)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.expandable:
        os.environ["BLUTRAIN_ALLOC_CONF"] = "expandable_segments:True"
    import blutrain.tensor as bt

    bt.zeros(1, device="cuda")  # the backend installs its allocator on first use
    report: dict[str, Any] = {}
    if not args.expandable:
        report["cost_us_per_alloc_free"] = bench_cost(args.repeats)
    if not args.no_gpt2:
        report["gpt2"] = bench_gpt2_memory(args, args.out)
        report["gpt2"]["expandable_segments"] = args.expandable
    name = "bench_alloc_expandable.json" if args.expandable else "bench_alloc.json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    if "cost_us_per_alloc_free" in report:
        print("\nallocation cost (host µs per alloc+free pair, same 4,000-request mix, median of "
              f"{args.repeats})")
        for name, us in report["cost_us_per_alloc_free"].items():
            print(f"  {name:<40} {us:8.2f}")
    if "gpt2" in report:
        g = report["gpt2"]
        gib = float(1 << 30)
        kind = ", expandable segments" if args.expandable else ""
        print(f"\nGPT-2 {g['preset']} B={g['batch_size']} T={g['seq_len']} fp32, last of {args.steps} steps "
              f"(BluTrain allocator{kind}): peak allocated {g['peak_allocated_bytes'] / gib:.2f} GiB, peak reserved "
              f"{g['peak_reserved_bytes'] / gib:.2f} GiB, (reserved - allocated) at peak "
              f"{100 * g['fragmentation_of_peak_reserved']:.1f}% of reserved, largest free block "
              f"{g['largest_free_block'] / MiB:.1f} MiB, {g['segments']} segments, OOM retries {g['oom_retries']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
