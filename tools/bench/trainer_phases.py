"""Where the trainer's step goes on the host: ``blutrain.train.Trainer.run()`` as ``blutrain train`` runs it, with
a clock around each phase of every step, so the CLI's step can be compared with tools/bench/gpt2.py's loop.

    python tools/bench/trainer_phases.py --device cuda --compile          # GPT-2 124M bf16, 16 x 1024, 60 steps
    python tools/bench/trainer_phases.py --device cpu --preset tiny --batch-size 4 --seq-len 64 --steps 12

Phases (host milliseconds, median and p90 over the steps after ``--skip``): ``launch`` (with ``--compile``: the
compiled step's call, which queues the whole step on the device and returns; eager steps run op by op and have
no such phase), ``next batch``
and ``bookkeeping`` (the next step's batches and the previous step's metrics row, done while the device runs),
``read`` (the step's one device-to-host read: the wait for the device), ``step`` (the whole train_step),
``between`` (from one train_step's return to the next call: the loop's own work, outside ``step_ms``) and, on
cuda, ``device`` (CUDA events around the whole train_step). Prints a table; writes ``--out`` JSON when given.
The clocks are plain ``time.perf_counter`` reads: they add microseconds, not a synchronisation.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: this file's siblings import as bench.*
from bench.arguments import measure_installed_plugins

# the trainer's methods timed, by the phase each one is
PHASES = {"_prefetch": "next batch", "_run_deferred": "bookkeeping", "_read": "read"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=20, help="first steps left out of the statistics (compile, warm-up)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.steps <= args.skip:
        ap.error(f"--steps must be above --skip ({args.skip}), got {args.steps}")
    return args


def timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            record.append((time.perf_counter() - t0) * 1e3)
    return call


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    from blutrain.train import TrainConfig, Trainer

    times: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(preset=args.preset, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                          seq_len=args.seq_len, max_steps=args.steps, eval_every=0, warmup_steps=5,
                          compile=args.compile, out=out, overwrite=True, sample_tokens=0)
        trainer = Trainer(cfg, stream=io.StringIO())
        for name, phase in PHASES.items():
            setattr(trainer, name, timed(times[phase], getattr(trainer, name)))
        events = _cuda_events() if args.device.startswith("cuda") else None
        step, ended, clocked = trainer.train_step, [0.0], [None]

        def train_step() -> dict[str, Any]:
            t0 = time.perf_counter()
            if ended[0]:
                times["between"].append((t0 - ended[0]) * 1e3)
            if trainer.compiled_step is not None and trainer.compiled_step is not clocked[0]:
                trainer.compiled_step = clocked[0] = timed(times["launch"], trainer.compiled_step)  # type: ignore[assignment]
            start = events() if events else None
            out_metrics = step()
            if events and start is not None:
                end = events()
                end.synchronize()
                times["device"].append(float(_elapsed(start, end)))
            ended[0] = time.perf_counter()
            times["step"].append((ended[0] - t0) * 1e3)
            return out_metrics

        trainer.train_step = train_step  # type: ignore[method-assign]
        trainer.run()
    return times


def _cuda_events() -> Callable[[], Any]:
    import cupy

    def mark() -> Any:
        ev = cupy.cuda.Event()
        ev.record()
        return ev
    return mark


def _elapsed(start: Any, end: Any) -> float:
    import cupy

    return float(cupy.cuda.get_elapsed_time(start, end))


def summary(times: dict[str, list[float]], skip: int) -> dict[str, dict[str, float]]:
    out = {}
    for phase, values in times.items():
        kept = values[skip:] if len(values) > skip else values
        if kept:
            ordered = sorted(kept)
            out[phase] = {"median_ms": statistics.median(kept), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
                          "n": len(kept)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    measure_installed_plugins()
    table = summary(measure(args), args.skip)
    print(f"{'phase':<12} {'median ms':>10} {'p90 ms':>9} {'steps':>6}")
    for phase in ("launch", "next batch", "bookkeeping", "read", "step", "device", "between"):
        if phase in table:
            row = table[phase]
            print(f"{phase:<12} {row['median_ms']:10.3f} {row['p90_ms']:9.3f} {int(row['n']):6d}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "phases": table},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
