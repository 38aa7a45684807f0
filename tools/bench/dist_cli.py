"""Several GPUs through the command line, as a user runs them: ``blutrain train`` on one GPU and under
``blutrain run -n N`` with ``--parallel MODE``, each configuration a fresh launch, the step time and tokens/s read
back from its metrics.jsonl (the median of the last steps, after the compile's warm-up), and the scaling of each
multi-GPU row against the one-GPU row of the same mode (compiled against compiled, eager against eager).

    python tools/bench/dist_cli.py --gpus 4 --out OUT [--steps 30] [--eager] [--modes ddp,zero=1,...]
    # tensor parallelism on GPT-2 774M: one GPU, tp=2, tp=4 and async TP, eager and compiled
    python tools/bench/dist_cli.py --gpus 4 --out OUT --preset gpt2-774m --batch-size 8 --steps 20 --eager \
        --modes "" --extra "tp=2@2;tp=4@4;tp=4,async=4@4;tp=2@2:eager;tp=4@4:eager;tp=4,async=4@4:eager"
    # context parallelism at T = 65536 on 4 GPUs, no one-GPU row
    python tools/bench/dist_cli.py --gpus 4 --out OUT --seq-len 65536 --batch-size 1 --no-single --modes "" \
        --config "model_overrides = { block_size = 65536 }" --extra "cp=4@4;cp=4,attn=ulysses@4"

Prints one table and writes OUT/dist_cli.json and each run's output to OUT/run_*.log. A configuration that
fails (out of memory, a refused mode) is a row that says why; the others still run. The default model and batch
are issue 21's: GPT-2 124M, bf16, micro-batch 16 x 1024 per GPU. A data-parallel row (ddp, zero, dp=) is
scored by its efficiency against the one-GPU row of the same compile flag; a row that trains on the same batch
as one GPU (tp=, cp=) by its speed-up over it and the largest |loss difference| over the steps both ran (the
same seed, data and weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: this file's siblings import as bench.*
from bench.arguments import measure_installed_plugins
from bench.dist_report import scaling_efficiency

TRAIN = ["--eval-every", "0", "--warmup-steps", "5"]
DATA_PARALLEL = ("ddp", "zero", "dp=")  # a mode naming one of these trains each rank on rows of its own


def command(gpus: int, flags: list[str], out: Path, args: argparse.Namespace) -> list[str]:
    """The launch of one configuration: ``blutrain train`` alone on one GPU, under ``blutrain run`` on several
    (no sample at the end: a config file sets ``sample_tokens = 0``, which no flag sets; ``--config`` adds its
    lines there)."""
    config = out.parent / "run_config.toml"
    config.write_text("sample_tokens = 0\n" + "".join(f"{line}\n" for line in args.config))
    train = ["blutrain", "train", "--config", str(config), *TRAIN, "--device", args.device, "--preset", args.preset,
             "--dtype", args.dtype, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--max-steps", str(args.steps), "--out", str(out), *flags]
    cli = [sys.executable, "-m", "blutrain.cli"]
    if gpus == 1:
        return [*cli, *train[1:]]
    return [*cli, "run", "-n", str(gpus), "--timeout", "300", "--", *train]


def summarize(rows: list[dict[str, Any]], tail: int) -> dict[str, Any]:
    """Median step ms and tokens/s over the last ``tail`` steps of a metrics.jsonl's step rows."""
    steps = [r for r in rows if "step_ms" in r and "tok_per_s" in r]
    last = steps[-tail:]
    if not last:
        return {}
    return {"step_ms": statistics.median(r["step_ms"] for r in last),
            "tok_per_s": statistics.median(r["tok_per_s"] for r in last), "loss": last[-1]["loss"],
            "steps": len(steps), "losses": [r["loss"] for r in steps]}


def scaling(results: list[dict[str, Any]]) -> None:
    """Each data-parallel row's efficiency, tokens/s(N) / (N x tokens/s(1)), and each same-batch row's speed-up,
    tokens/s(N) / tokens/s(1), and max |loss(N) - loss(1)| over the steps both ran, against the one-GPU row of
    the same compile flag."""
    single = {r["compiled"]: r for r in results if r["gpus"] == 1 and "tok_per_s" in r}
    for r in results:
        one = single.get(r["compiled"])
        if r["gpus"] == 1 or one is None or "tok_per_s" not in r:
            continue
        if any(key in r["mode"] for key in DATA_PARALLEL):
            efficiency = scaling_efficiency(r["tok_per_s"], one["tok_per_s"], r["gpus"])
            if efficiency is not None:
                r["efficiency"] = efficiency
        else:
            r["speedup"] = r["tok_per_s"] / one["tok_per_s"]
            both = list(zip(r["losses"], one["losses"], strict=False))
            r["max_dloss"] = max((abs(a - b) for a, b in both), default=None)


def main() -> int:
    measure_installed_plugins()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tail", type=int, default=10, help="steps the medians are taken over")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (MPI ranks: the plumbing, not a measurement)")
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--config", action="append", default=[],
                    help="a line of the runs' TOML config (e.g. 'model_overrides = { block_size = 65536 }')")
    ap.add_argument("--modes", default="ddp,zero=1,zero=2", help="modes on every GPU count above 1")
    ap.add_argument("--extra", default="",
                    help="more rows: MODE@N[:eager];... (e.g. 'ddp,grad_dtype=bf16@4;tp=4@4:eager'), compiled "
                         "unless ':eager'")
    ap.add_argument("--eager", action="store_true", help="also every row without --compile")
    ap.add_argument("--no-single", action="store_true", help="no one-GPU rows (a model that does not fit one)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; rows after it are skipped")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    counts = [n for n in (1, 2, 4, 8, 16) if n <= args.gpus]
    plan: list[tuple[int, str, bool]] = []
    for compiled in ([True, False] if args.eager else [True]):
        if not args.no_single:
            plan.append((1, "", compiled))
        plan += [(n, mode, compiled) for n in counts[1:] for mode in args.modes.split(",")] if args.modes else []
    for item in filter(None, args.extra.split(";")):
        mode, _, where = item.rpartition("@")
        n, _, flag = where.partition(":")
        if not mode or not n.isdigit() or flag not in ("", "eager"):
            ap.error(f"--extra: each row must be MODE@N or MODE@N:eager, got {item!r}")
        plan.append((int(n), mode, flag != "eager"))
    start = time.monotonic()
    results: list[dict[str, Any]] = []
    for gpus, mode, compiled in plan:
        row: dict[str, Any] = {"gpus": gpus, "mode": mode or "single", "compiled": compiled}
        results.append(row)
        if time.monotonic() - start > args.budget:
            row["error"] = "skipped: over the time budget"
            continue
        flags = (["--compile"] if compiled else []) + (["--parallel", mode] if mode else [])
        run_dir = args.out / f"run_{gpus}_{(mode or 'single').replace(',', '_').replace('=', '')}_{int(compiled)}"
        cmd = command(gpus, flags, run_dir, args)
        row["command"] = " ".join(cmd[2:])
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        row["wall_s"] = round(time.monotonic() - t0, 1)
        metrics = run_dir / "metrics.jsonl"
        (args.out / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)  # warnings too (e.g. no graph)
        if proc.returncode != 0 or not metrics.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            row["error"] = tail[-1][:160] if tail else f"exit {proc.returncode}"
            continue
        row |= summarize([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()], args.tail)
        scaling(results)
        (args.out / "dist_cli.json").write_text(json.dumps(results, indent=1))
    scaling(results)
    (args.out / "dist_cli.json").write_text(json.dumps(results, indent=1))
    print(f"{args.preset} {args.dtype}, micro-batch {args.batch_size} x {args.seq_len} per data-parallel rank, "
          f"{args.steps} steps, medians of the last {args.tail}; against 1 GPU of the same compile flag: eff. (data "
          "parallel) or speed-up and max |dloss| over the steps (same batch)")
    print(f"{'mode':<24}{'GPUs':>5}{'compiled':>9}{'step ms':>9}{'tokens/s':>12}{'eff./x':>8}{'loss':>8}"
          f"{'max|dl|':>9}  result")
    for r in results:
        eff = (f"{100 * r['efficiency']:.1f}%" if "efficiency" in r
               else f"{r['speedup']:.2f}x" if "speedup" in r else "-")
        dloss = f"{r['max_dloss']:.4f}" if r.get("max_dloss") is not None else "-"
        if "tok_per_s" in r:
            print(f"{r['mode']:<24}{r['gpus']:>5}{'yes' if r['compiled'] else 'no':>9}{r['step_ms']:>9.2f}"
                  f"{r['tok_per_s']:>12,.0f}{eff:>8}{r['loss']:>8.3f}{dloss:>9}  ok ({r['wall_s']} s)")
        else:
            print(f"{r['mode']:<24}{r['gpus']:>5}{'yes' if r['compiled'] else 'no':>9}{'':>46}  {r.get('error')}")
    return 0 if all("tok_per_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
