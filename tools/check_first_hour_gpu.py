"""The GPU points of a user's first hour (issue 27): out of memory, and a rank killed mid-step.

(a) Out of memory. A short GPT-2 (124M) run on one GPU writes step checkpoints; its peak device memory is read
    from its metrics.jsonl. The run is then resumed while another process (CuPy) holds all of the GPU's free
    memory but half of that peak, so the resumed step runs out. It must exit non-zero with the allocator's
    message in one line (what was asked, what is held, what to try) and no traceback, and leave the run's
    checkpoints, metrics and plot byte for byte as they were, the checkpoint loadable.
    The first run's metrics.jsonl must also give an MFU in (0, 1) and the peak allocated memory on every step.
(b) A dead rank. ``blutrain run -n 2 --timeout T -- blutrain train --parallel ddp`` trains (nccl on two GPUs);
    once both ranks have finished steps, one rank gets SIGKILL. Every rank must be gone within T + the grace
    period + a margin, ``blutrain run`` must exit non-zero naming the dead rank, and no process of the job may
    be left. ``--device cpu --dist-backend mpi`` runs the same check on the CPU (the tests do).

Prints a PASS/FAIL table (SKIP where the machine lacks what a check needs) and exits 0 when nothing failed.

    python tools/check_first_hour_gpu.py                        # both checks on the GPU(s)
    python tools/check_first_hour_gpu.py --only dead-rank --device cpu --dist-backend mpi
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# a short run: few steps, a short sample, one validation batch; flags give the model and the batch
QUICK = """\
warmup_steps = 1
eval_every = 0
eval_batches = 1
sample_tokens = 8
"""


@dataclass
class Result:
    """One row of the table."""

    check: str
    status: str  # PASS, FAIL or SKIP
    detail: str


def blutrain(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "blutrain.cli", *(str(a) for a in args)]


def error_line(stderr: str) -> tuple[str | None, str]:
    """The one error line of a failed command's stderr (lines prefixed ``[rankN]:`` by the launcher are the
    ranks'), or None with the reason where there is a traceback or more than one line."""
    if "Traceback" in stderr:
        return None, "a traceback was printed"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if len(lines) != 1:
        return None, f"{len(lines)} lines on stderr, expected one"
    return lines[0], ""


def out_of_memory_problems(line: str) -> list[str]:
    """What the allocator's out-of-memory line lacks: what was asked, what is held, what to try."""
    wanted = {"what was asked": "tried to allocate", "what is held": "reserved", "what to try": "--auto-batch",
              "that it is out of memory": "out of memory"}
    return [what for what, text in wanted.items() if text not in line]


def snapshot(directory: Path) -> dict[str, str]:
    """Every file of a run under ``directory`` → SHA-256 of its bytes; config.toml, which a resumed run
    writes anew (it records the resume), is left out."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "config.toml"}


def metric_rows(out: Path) -> list[dict[str, object]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def job_processes(run_id: str) -> dict[int, dict[str, str]]:
    """pid → environment of every process whose environment has ``BLUTRAIN_RUN_ID=run_id`` (the launcher and
    its ranks, and whatever they started)."""
    found = {}
    marker = f"BLUTRAIN_RUN_ID={run_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in raw.split(b"\0"):
            env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)
            found[int(entry.name)] = env
    return found


def rank_pids(run_id: str) -> dict[int, int]:
    """rank → pid of the job's rank processes (those with RANK set)."""
    return {int(env["RANK"]): pid for pid, env in job_processes(run_id).items() if env.get("RANK", "").isdigit()}


def gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no GPU
        return 0


# -- (a) out of memory ---------------------------------------------------------------------------------------
HOG = """\
import sys, cupy
keep = int(sys.argv[1])
free, _ = cupy.cuda.runtime.memGetInfo()
held = cupy.empty(max(free - keep, 0), dtype=cupy.uint8)
print(held.nbytes, flush=True)
sys.stdin.read()
"""


def metrics_problems(rows: Sequence[dict[str, object]]) -> list[str]:
    """What a GPU run's metrics.jsonl lacks: an MFU in (0, 1) and a positive peak of allocated memory on every
    step (the progress line prints the same numbers)."""
    problems = []
    mfu = [m.get("mfu") for m in rows]
    if not rows or not all(isinstance(v, float) and 0 < v < 1 for v in mfu):
        problems.append(f"mfu not in (0, 1) on every step: {mfu}")
    mem = [m.get("mem_peak_bytes") for m in rows]
    if not rows or not all(isinstance(v, int) and v > 0 for v in mem):
        problems.append(f"mem_peak_bytes not positive on every step: {mem}")
    return problems


def check_out_of_memory(work: Path, preset: str, batch_size: int, seq_len: int, dtype: str) -> list[Result]:
    """Two rows: MFU and memory in the first run's metrics, then the out-of-memory check itself."""
    name = "out of memory: one line, non-zero exit, checkpoints intact"
    metrics_name = "MFU and peak memory in metrics.jsonl on the GPU"
    if gpu_count() < 1:
        return [Result(metrics_name, "SKIP", "needs a GPU and CuPy"), Result(name, "SKIP", "needs a GPU and CuPy")]
    out = work / "oom"
    flags: list[str | Path] = ["--config", work / "quick.toml", "--preset", preset, "--device", "cuda", "--dtype",
                               dtype, "--batch-size", str(batch_size), "--seq-len", str(seq_len)]
    first = subprocess.run(blutrain("train", *flags, "--max-steps", "3", "--checkpoint-every", "1", "--out", out),
                           capture_output=True, text=True, timeout=600)
    if first.returncode != 0:
        failed = f"the first run failed ({first.returncode}): {first.stderr.strip()[-300:]}"
        return [Result(metrics_name, "FAIL", failed), Result(name, "FAIL", failed)]
    rows = metric_rows(out)
    problems = metrics_problems(rows)
    shown = ", ".join(f"step {m['step']}: MFU {m.get('mfu')}, {m.get('mem_peak_bytes')} B" for m in rows)
    metrics = Result(metrics_name, "FAIL" if problems else "PASS", "; ".join(problems) or shown)
    peaks = [int(str(m["mem_peak_bytes"])) for m in rows if "mem_peak_bytes" in m]
    if not peaks:
        return [metrics, Result(name, "FAIL", "metrics.jsonl has no mem_peak_bytes on the GPU")]
    before = snapshot(out)
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(max(peaks) // 2)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None
        held = int(hog.stdout.readline() or 0)
        resumed = subprocess.run(blutrain("train", *flags, "--max-steps", "5", "--resume",
                                          out / "step_000002.safetensors"), capture_output=True, text=True,
                                 timeout=600)
    finally:
        hog.kill()
        hog.wait()
    line, why = error_line(resumed.stderr)
    problems = [why] if line is None else out_of_memory_problems(line)
    if resumed.returncode == 0:
        problems.append("exit code 0")
    if snapshot(out) != before:
        problems.append("the run's files changed")
    from blutrain.train import load_checkpoint

    try:
        load_checkpoint(out / "step_000002.safetensors")
    except Exception as exc:
        problems.append(f"the checkpoint does not load: {exc}")
    detail = (f"peak {max(peaks) / 2**30:.1f} GiB, {held / 2**30:.1f} GiB held by another process; exit "
              f"{resumed.returncode}: {(line or resumed.stderr.strip()[-200:])[:160]}")
    return [metrics, Result(name, "FAIL" if problems else "PASS",
                            "; ".join(problems) + (" | " if problems else "") + detail)]


# -- (b) a rank killed mid-step -------------------------------------------------------------------------------
def check_dead_rank(work: Path, device: str, backend: str, timeout: float, grace: float, victim: int = 1,
                    model: Sequence[str] = ("--preset", "tiny", "--batch-size", "4", "--seq-len", "128")) -> Result:
    name = f"rank {victim} of 2 killed (SIGKILL) mid-step: all exit, named, none left"
    if device.startswith("cuda") and gpu_count() < 2:
        return Result(name, "SKIP", "needs 2 GPUs (or --device cpu --dist-backend mpi)")
    out = work / "dead-rank"
    run_id = f"first-hour-check-{os.getpid()}-{time.time_ns()}"
    cmd = blutrain("run", "-n", "2", "--timeout", str(timeout), "--grace", str(grace), "--", "blutrain", "train",
                   "--config", work / "quick.toml", *model, "--device", device, "--dist-backend", backend,
                   "--parallel", "ddp", "--max-steps", "100000", "--out", out)
    env = {**os.environ, "BLUTRAIN_RUN_ID": run_id}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while len(metric_rows(out)) < 2:
            if launcher.poll() is not None:
                _, err = launcher.communicate()
                return Result(name, "FAIL", f"the job ended before training ({launcher.returncode}): "
                                            f"{err.strip()[-300:]}")
            if time.monotonic() > deadline:
                return Result(name, "FAIL", "the job did not reach its second step in 300 s")
            time.sleep(0.05)
        ranks = rank_pids(run_id)
        if sorted(ranks) != [0, 1]:
            return Result(name, "FAIL", f"found ranks {sorted(ranks)} of the job, expected [0, 1]")
        killed_at = time.monotonic()
        os.kill(ranks[victim], signal.SIGKILL)
        limit = timeout + grace + 30
        try:
            _, err = launcher.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            return Result(name, "FAIL", f"blutrain run was still running {limit:.0f} s after the kill")
        took = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    problems = []
    if launcher.returncode == 0:
        problems.append("blutrain run exited 0")
    named = f"rank {victim} (pid {ranks[victim]}) killed by SIGKILL"
    if named not in err:
        problems.append(f"stderr does not say {named!r}")
    left = sorted(job_processes(run_id))
    if left:
        problems.append(f"processes left: {left}")
    detail = f"all gone {took:.1f} s after the kill (limit {timeout + grace + 30:.0f} s); exit {launcher.returncode}"
    return Result(name, "FAIL" if problems else "PASS", "; ".join(problems) + (" | " if problems else "") + detail)


def table(results: Sequence[Result]) -> str:
    width = max(len(r.check) for r in results)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{r.check:<{width}}  {r.status:<6}  {r.detail}" for r in results]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("oom", "dead-rank"), help="run one check")
    ap.add_argument("--work", type=Path, default=None, help="a directory for the runs (default: a temporary one)")
    ap.add_argument("--preset", default="gpt2-124m", help="the model of the out-of-memory check")
    ap.add_argument("--batch-size", type=int, default=16, help="the out-of-memory check's micro-batch")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda", help="the dead-rank check's device: cuda or cpu")
    ap.add_argument("--dist-backend", default="nccl", help="the dead-rank check's comm backend: nccl or mpi")
    ap.add_argument("--timeout", type=float, default=30.0, help="blutrain run --timeout (collective timeout, s)")
    ap.add_argument("--grace", type=float, default=5.0, help="blutrain run --grace (s)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="first-hour-gpu-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "quick.toml").write_text(QUICK)
        results = []
        if args.only in (None, "oom"):
            results += check_out_of_memory(work, args.preset, args.batch_size, args.seq_len, args.dtype)
        if args.only in (None, "dead-rank"):
            results.append(check_dead_rank(work, args.device, args.dist_backend, args.timeout, args.grace))
    print(table(results), flush=True)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
