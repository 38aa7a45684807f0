"""Host µs per op, BluTrain against PyTorch in the same process, and where BluTrain's time goes (issue 22).

The op set (tools/bench/dispatch_cases.py): add, mul, casts float32 ↔ bfloat16, matmul, linear with bias,
layer_norm, gelu, causal attention (over heads, and GPT-2's packed form), cross-entropy, embedding; each
forward without and with requires_grad, each backward (``y.backward(seed, retain_graph=True)`` of the one-op
graph: engine, derivative rule, leaf gradients), and one AdamW step over a GPT-2 block's 12 parameters (the
"adamw" optimizer plugin; PyTorch's ``AdamW(fused=True)``). ``small`` shapes make the framework's host cost
dominate; ``gpt2`` shapes (16 × 1024 × 768) make the device time visible on cuda.

Timing method: tools/bench/dispatch_timing.py (host µs: N calls issued back to back without synchronising, the
device synchronised outside the timed window; device µs on cuda: CUDA events around N calls queued behind a
spin kernel). The breakdown: tools/bench/dispatch_breakdown.py (cProfile, by the module each function lives in).

PyTorch is optional: without it the rows are BluTrain's alone and the JSON says so. Prints the tables, writes
JSON and (with matplotlib) a PNG.

    uv run --no-sync python tools/bench_dispatch.py [--device cpu|cuda] [--sizes small,gpt2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.arguments import choice_list, measure_installed_plugins
from bench.dispatch_breakdown import CATEGORIES, profile
from bench.dispatch_cases import OPS, SHAPES, Case, Framework, blutrain_framework, cases, prepare, torch_framework
from bench.dispatch_timing import CupyClock, DeviceTimer, TorchClock, host_time

from blutrain.tensor import BluTrainError

FRAMEWORKS = ("blutrain", "torch")
# what sets the threads of NumPy's BLAS and PyTorch's CPU kernels (recorded: they change CPU timings)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
DTYPES = ("float32", "bfloat16")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    results = Path(__file__).parent / "results"
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="compute dtype of every op but the casts (default float32)")
    p.add_argument("--sizes", type=choice_list(tuple(SHAPES)), default=None,
                   help="comma-separated shape sets (default: small on cpu, small,gpt2 on cuda)")
    p.add_argument("--ops", type=choice_list(OPS), default=list(OPS), help="a subset of the op set")
    p.add_argument("--frameworks", type=choice_list(FRAMEWORKS), default=list(FRAMEWORKS))
    p.add_argument("--calls", type=_positive, default=None,
                   help="calls per timed batch, small shapes (default 1000 on cpu; 200 on cuda, so that a batch "
                        "stays under the ~1,000 launches the queue holds)")
    p.add_argument("--calls-gpt2", type=_positive, default=20,
                   help="calls per timed batch, gpt2 shapes (few, so that on cuda the launch queue never fills)")
    p.add_argument("--batches", type=_positive, default=15, help="timed batches per case (median reported)")
    p.add_argument("--warmup", type=_positive, default=20, help="untimed calls before a case's batches")
    p.add_argument("--device-calls", type=_positive, default=50,
                   help="calls timed by CUDA events behind one spin kernel (cuda only)")
    p.add_argument("--profile-calls", type=_positive, default=300,
                   help="calls of each BluTrain case profiled for the breakdown (small shapes; gpt2 uses "
                        "--calls-gpt2)")
    p.add_argument("--out", type=Path, default=results / "bench_dispatch.json", help="the JSON written")
    p.add_argument("--png", type=Path, default=None, help="the bar chart (default: beside --out, .png)")
    args = p.parse_args(argv)
    if args.calls is None:
        args.calls = 1000 if args.device == "cpu" else 200
    if args.sizes is None:
        args.sizes = ["small"] if args.device == "cpu" else ["small", "gpt2"]
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    if args.out.exists() and args.out.is_dir():
        p.error(f"--out must be a file path, got the directory {args.out}; pass e.g. {args.out / 'dispatch.json'}")
    return args


def frameworks(names: Sequence[str], device: str, dtype: str, notes: list[str]) -> list[Framework]:
    """The frameworks asked for that can run here; one that cannot is a note, not an error (PyTorch is optional)."""
    found = [blutrain_framework(device, dtype)] if "blutrain" in names else []
    if "torch" in names:
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            notes.append("PyTorch is not installed in this environment: BluTrain rows only")
        else:
            if device == "cuda" and not torch.cuda.is_available():
                notes.append(f"PyTorch {torch.__version__} sees no CUDA device: BluTrain rows only")
            else:
                found.append(torch_framework(device, dtype))
    return found


def _device_clock(fw: Framework) -> DeviceTimer:
    return DeviceTimer(CupyClock() if fw.name == "blutrain" else TorchClock(), fw.synchronize)


def run(args: argparse.Namespace, notes: list[str]) -> tuple[list[Framework], list[dict[str, Any]],
                                                           list[dict[str, Any]]]:
    fws = frameworks(args.frameworks, args.device, args.dtype, notes)
    timers = {fw.name: _device_clock(fw) for fw in fws} if args.device == "cuda" else {}
    rows: list[dict[str, Any]] = []
    breakdowns: list[dict[str, Any]] = []
    for size in args.sizes:
        shapes = SHAPES[size]
        calls = args.calls if size == "small" else args.calls_gpt2
        for case in (c for c in cases() if c.op in args.ops):
            for fw in fws:
                row, prepared = _time_case(fw, case, shapes, calls, args, timers.get(fw.name))
                rows.append(row)
                if fw.name == "blutrain" and prepared is not None and row["host_us"] is not None:
                    n = args.profile_calls if size == "small" else args.calls_gpt2
                    b = profile(prepared, n, fw.synchronize)
                    breakdowns.append({**_key(case, size), "host_us": row["host_us"],
                                       "python_calls_per_op": b.python_calls_per_op, "us": b.us(row["host_us"]),
                                       "top": [{"function": f, "category": c, "share": s} for f, c, s in b.top]})
    return fws, rows, breakdowns


def _key(case: Case, size: str) -> dict[str, Any]:
    return {"op": case.op, "pass": case.pass_, "requires_grad": case.requires_grad, "size": size,
            "case": case.label}


def _time_case(fw: Framework, case: Case, shapes: Any, calls: int, args: argparse.Namespace,
               timer: DeviceTimer | None) -> tuple[dict[str, Any], Callable[[], Any] | None]:
    row: dict[str, Any] = {**_key(case, shapes.name), "framework": fw.name, "shape": None, "host_us": None,
                           "host_min_us": None, "host_max_us": None, "device_us": None, "error": None}
    try:
        prepared = prepare(fw, case, shapes)
        row["shape"] = prepared.shape
        t = host_time(prepared.call, calls, args.batches, args.warmup, fw.synchronize)
        row.update(host_us=t.median_us, host_min_us=t.min_us, host_max_us=t.max_us)
        if timer is not None:
            row["device_us"] = timer.time(prepared.call, min(args.device_calls, calls), t.median_us)
    except Exception as e:  # a case that fails is a row saying why; the others still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row, None
    return row, prepared.call


# -- reporting --------------------------------------------------------------------------------------------------
def _fmt(x: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def _with_min(row: dict[str, Any] | None, width: int) -> str:
    """``median (min)`` µs of a row, or "-"."""
    if not row or row["host_us"] is None:
        return f"{'-':>{width}}"
    return f"{row['host_us']:.1f} ({row['host_min_us']:.1f})".rjust(width)


def table(rows: list[dict[str, Any]], device: str) -> str:
    """Per case: BluTrain and PyTorch host µs (median, and min over batches), the ratio of the medians, and on
    cuda the device µs of each."""
    by = {(r["size"], r["case"], r["framework"]): r for r in rows}
    keys = list(dict.fromkeys((r["size"], r["case"]) for r in rows))
    head = f"{'size':<6} {'case':<24} {'shape':<28} {'blutrain µs (min)':>19} {'torch µs (min)':>19} {'bt/torch':>8}"
    if device == "cuda":
        head += f" {'bt dev µs':>9} {'torch dev µs':>12}"
    lines = [head]
    for size, case in keys:
        bt, th = by.get((size, case, "blutrain")), by.get((size, case, "torch"))
        shape = next((r["shape"] for r in (bt, th) if r and r["shape"]), "")
        bt_us, th_us = (bt or {}).get("host_us"), (th or {}).get("host_us")
        ratio = bt_us / th_us if bt_us and th_us else None
        line = (f"{size:<6} {case:<24} {shape:<28} {_with_min(bt, 19)} {_with_min(th, 19)} "
                f"{_fmt(ratio, 8, 2)}")
        if device == "cuda":
            line += f" {_fmt((bt or {}).get('device_us'), 9)} {_fmt((th or {}).get('device_us'), 12)}"
        errors = [f"{r['framework']}: {r['error']}" for r in (bt, th) if r and r["error"]]
        lines.append(line + ("  " + "; ".join(errors) if errors else ""))
    return "\n".join(lines)


def breakdown_table(breakdowns: list[dict[str, Any]]) -> str:
    """Per BluTrain case: host µs split by category (cProfile shares scaled to the unprofiled µs)."""
    cats = [c for c in CATEGORIES if any(b["us"][c] >= 0.05 for b in breakdowns)]
    head = f"{'size':<6} {'case':<24} {'host µs':>8} {'py calls':>8} " + " ".join(f"{c:>9}" for c in cats)
    lines = [head]
    for b in breakdowns:
        lines.append(f"{b['size']:<6} {b['case']:<24} {b['host_us']:>8.1f} {b['python_calls_per_op']:>8.0f} "
                     + " ".join(f"{b['us'][c]:>9.1f}" for c in cats))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], breakdowns: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """Bars of host µs per case (BluTrain beside PyTorch) and BluTrain's breakdown, one size per row of panels.
    Returns a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG written"
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(15, len(sizes) * (0.1 * len(rows) / len(sizes) + 1.5)),
                             squeeze=False)
    for i, size in enumerate(sizes):
        ax, bx = axes[i]
        labels = list(dict.fromkeys(r["case"] for r in rows if r["size"] == size))
        for j, fw in enumerate(FRAMEWORKS):
            vals = {r["case"]: r["host_us"] or 0.0 for r in rows if r["size"] == size and r["framework"] == fw}
            if vals:
                ax.barh([k + 0.4 * j for k in range(len(labels))], [vals.get(c, 0.0) for c in labels], height=0.4,
                        label=fw)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("host µs per call (log scale)")
        ax.set_title(f"{size}: host µs per call")
        ax.legend(fontsize=7)
        mine = [b for b in breakdowns if b["size"] == size]
        left = [0.0] * len(mine)
        for c in CATEGORIES:
            widths = [b["us"][c] for b in mine]
            if any(w > 0 for w in widths):
                bx.barh(range(len(mine)), widths, left=left, label=c)
                left = [x + w for x, w in zip(left, widths, strict=True)]
        bx.set_yticks(range(len(mine)), [b["case"] for b in mine], fontsize=7)
        bx.invert_yaxis()
        bx.set_xlabel("BluTrain host µs per call, by category")
        bx.set_title(f"{size}: where BluTrain's host time goes")
        bx.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meta(args: argparse.Namespace, fws: list[Framework], notes: list[str]) -> dict[str, Any]:
    import numpy as np

    info: dict[str, Any] = {
        "commit": _commit(), "device": args.device, "dtype": args.dtype, "sizes": args.sizes,
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "numpy": np.__version__, "frameworks": {fw.name: fw.version for fw in fws},
        "calls": args.calls, "calls_gpt2": args.calls_gpt2, "batches": args.batches, "warmup": args.warmup,
        "device_calls": args.device_calls, "profile_calls": args.profile_calls,
        "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loop_us": host_time(lambda: None, args.calls, args.batches, 0, lambda: None).median_us,
        "threads_env": {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
        "categories": CATEGORIES, "notes": notes,
    }
    if "torch" in info["frameworks"]:
        info["torch_threads"] = importlib.import_module("torch").get_num_threads()
    if args.device == "cuda":
        from blutrain.tensor import DeviceProperties, device

        backend = device("cuda").backend
        info["gpu"] = backend.device_name(0) if isinstance(backend, DeviceProperties) else None
    return info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    measure_installed_plugins()
    notes: list[str] = []
    try:
        fws, rows, breakdowns = run(args, notes)
    except BluTrainError as e:  # e.g. --device cuda where the cuda backend cannot run
        print(f"bench_dispatch: error: {e}", file=sys.stderr)
        return 2
    if not fws:
        print(f"bench_dispatch: error: none of --frameworks {','.join(args.frameworks)} can run here "
              f"({'; '.join(notes)}); add blutrain or install PyTorch", file=sys.stderr)
        return 2
    info = meta(args, fws, notes)
    title = (f"bench_dispatch on {args.device} ({info.get('gpu') or info['cpu']}), {args.dtype}, "
             f"commit {info['commit']}")
    png_note = plot(rows, breakdowns, args.png, title)
    if png_note:
        notes.append(png_note)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": info, "ops": list(args.ops), "results": rows,
                                    "breakdown": breakdowns}, indent=2) + "\n")
    print(title)
    print(table(rows, args.device))
    print("\nBluTrain host µs by category (cProfile shares of the profiled time, scaled to the host µs above):")
    print(breakdown_table(breakdowns))
    for note in notes:
        print(f"note: {note}")
    print(f"\nwrote {args.out}" + ("" if png_note else f" and {args.png}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
