#!/usr/bin/env python3
"""Data-parallel training on several GPUs, BluTrain beside PyTorch: scaling, exposed communication, same losses.

Why this tool: issue 21's acceptance is a claim about several GPUs, and it holds only when each framework is
measured against itself on one GPU, compiled against compiled and eager against eager, in the same run.

    python tools/bench/dist.py                         # every GPU of the machine (--gpus N), both stages
    python tools/bench/dist.py --gpus 4 --profile      # also: exposed communication per step (nsys, rank 0)
    python tools/bench/dist.py --modes ddp,zero1 --impls compiled --stages scaling
    python tools/bench/dist.py --device cpu            # the same plumbing on MPI ranks: the tiny preset
    python tools/bench/dist.py --model llama --preset llama-1b --seq-len 2048 --sizes 1,4 --modes zero3 \
        --torch-modes fsdp2 --impls compiled --stages scaling   # ZeRO-3 against PyTorch FSDP2 (issue 25)
    python tools/bench/dist.py --gpus 4 --sizes 1,2,4 --modes tp,tp-async --torch-modes tp,tp-async \
        --stages scaling --preset gpt2-774m --batch-size 8      # tensor parallelism against PyTorch's own TP

What runs
1. ``scaling``: ``--model`` (a registered family, default gpt2) at ``--preset`` (gpt2-124m for gpt2; another
   family names its own), ``--precision`` bf16 (autocast, float32 master weights), micro-batch ``--batch-size``
   × ``--seq-len`` per GPU (gpt2: 16 × 1024; another family: 4 × 2048, see --help), on 1, 2, 4, ... GPUs up to
   ``--gpus`` (``--sizes`` to choose). BluTrain eager and compiled (``--impls``): each configuration is a
   ``blutrain.train.Trainer`` built as ``blutrain train --model NAME`` builds it — ``--compile`` traces the whole
   step with ``blutrain.compiler.compile`` — with ``--parallel`` ddp, zero=1, zero=2, zero=3 (``--modes``) on
   N > 1 GPUs, and the plain model on one. PyTorch (``--frameworks``): tools/bench/gpt2.py's implementation of
   the same family (its ``TORCH_MODELS``), ``torch.optim.AdamW(fused=True)``, eager and ``torch.compile``, under
   ``DistributedDataParallel`` (``--torch-modes``: also ddp + ZeroRedundancyOptimizer as zero1, FSDP
   SHARD_GRAD_OP as zero2, FULL_SHARD as zero3, and fsdp2: ``fully_shard`` per block and the root, bf16 through
   ``MixedPrecisionPolicy``, compiled block by block before sharding; tp: DTensor's ``parallelize_module``
   over every GPU in the Megatron layout, q/k/v and fc column-parallel, the output projections row-parallel,
   n_head / N heads a rank, embedding and LM head vocab-parallel and tied, the loss through ``loss_parallel``,
   the LayerNorms replicated; tp-async: the same sequence-parallel, with inductor's micro-pipeline TP pass,
   compiled and CUDA only: tools/bench/dist_torch_tp.py). BluTrain's ``--modes tp,tp-async`` and PyTorch's
   train every rank on the one-GPU run's rows. A mode that does not compile, or runs out of memory, is a row
   that says so; one that this PyTorch or device cannot run (tp-async eager, or on the CPU) is a skipped row
   saying why.
2. ``equivalence``: the same global batch (G × micro-batch, G = the largest size) for ``--equiv-steps`` 50
   steps, same seed and data, the learning rate warmed up linearly over ``--equiv-lr-warmup`` 10 steps (both
   frameworks), on 1, 2 and G GPUs whatever ``--sizes`` says: BluTrain compiled on one GPU
   accumulating G micro-batches, compiled DDP on 2 and on G GPUs (G/N micro-batches each): max |Δloss| against
   the one-GPU run; the same for PyTorch DDP (eager), its own 1-vs-N difference, the bf16 noise floor; and
   BluTrain in fp32 on 1 and G GPUs (max relative |Δloss|), on N GPUs once with the default all-reduce
   (``ddp``) and once with ``--parallel ddp,reduce=ordered`` (``ddp-ordered``: each bucket summed in rank
   order, bit-identical to one GPU accumulating when each rank runs one micro-batch, N a power of two).

How it is measured
- A launch is one framework on N ranks (``blutrain run -n N``; ``python -m torch.distributed.run``) running
  its configurations one after another. A configuration that fails ends its launch with its error as its
  row; the configurations after it are launched again, so one failure costs one row.
- Step time: the wall time of a whole step (forward, backward, gradient reduction, clip, optimizer and the
  step's host read of its loss, which waits for the device), the slowest rank's per step, the median over
  ``--steps`` timed steps after ``--warmup`` (compiled: the first call runs eagerly, the second traces).
  tokens/s = tokens of one step over all ranks / step time (tp, tp-async: one rank's tokens, the ranks share
  them). Efficiency = tokens/s(N) / (N × tokens/s(1)) of the same framework and implementation; a tp row is
  also printed as its speed-up (tokens/s(N) / tokens/s(1)), its max |Δloss| against that one-GPU run over the
  steps both ran (the same rows, seed and weights) and its peak memory per rank.
- Memory: peak allocated per rank over build and warm-up, above what the rank held before (blutrain-alloc's
  or CuPy's pool statistics; PyTorch's max_memory_allocated); the largest rank's.
- ``--profile``: rank 0 profiles ``--profile-steps`` steps after the timed ones of every scaling row (1 GPU too:
  the baseline's kernels), under ``torch.profiler`` (``--profiler torch``, the default where PyTorch is
  installed: a Chrome trace per configuration) or under ``nsys profile --trace=cuda,nvtx`` (``--profiler nsys``:
  an SQLite export), kernels inside CUDA graphs one by one. Per step: comm = ms of NCCL kernels (their union),
  exposed = the part of it when no other kernel ran (tools/bench/dist_profile.py); with torch, a per-kernel
  table too (the top kernels printed, all in the JSON's ``kernels``, "(idle)" the time no kernel ran). A row
  without a profile shows "-".
- ``--budget`` seconds (default 480 on the GPU): configurations that would start after it are skipped, and are
  rows too; one that started before is stopped 90 s after it at the latest. ``--config-timeout`` bounds one
  configuration, build and compile included (a hang is a row).

Writes ``bench_dist.json`` (rewritten after every launch), ``bench_dist.txt`` (the table), ``bench_dist.png``
and ``runs/<launch>/`` (the launch's job, log, each rank's JSON, nsys reports) to ``--out`` (default
$OUT/bench_dist when OUT is set, else tools/results/bench_dist). The table is printed last. Exit code 1 when
a row failed (error, out of memory, timeout); skipped rows do not count.

``--worker JOB.json`` is the per-rank entry point the launches call (tools/bench/dist_worker.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: this file's siblings import as bench.*
from bench import dist_options as options
from bench.arguments import measure_installed_plugins
from bench.dist_options import gpu_names
from bench.dist_profile import (
    TORCH_TRACE_SUFFIX,
    costs_from_chrome_traces,
    costs_from_exports,
    export_missing,
    nsys_command,
    nsys_graph_node_tracing,
    nsys_path,
)
from bench.dist_report import (
    STAGES,
    Config,
    Row,
    chart,
    collect,
    fill_efficiencies,
    fill_loss_differences,
    format_table,
    goals,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()
TOP_KERNELS = 14  # kernel rows printed per profiled configuration (all of them are in the JSON)
EXIT_GRACE_S = 120.0  # after every configuration reported: time for the ranks to leave (nsys writes reports)
BUDGET_GRACE_S = 90.0  # a configuration that started before the --budget ran out is stopped this long after it


# -- the plan ----------------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One framework on ``gpus`` ranks and the configurations of one stage it runs, in order."""

    stage: str
    framework: str
    gpus: int
    configs: list[Config] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{'equiv-' if self.stage == 'equivalence' else ''}{self.framework}-{self.gpus}gpu"


def run_order(sizes: Sequence[int]) -> list[int]:
    """One GPU first (every efficiency's baseline), then the largest size, then the others from the top: when
    the --budget runs out, what is skipped is the in-between sizes."""
    rest = sorted((n for n in set(sizes) if n != 1), reverse=True)
    return ([1] if 1 in sizes else []) + rest


def plan(a: argparse.Namespace) -> list[Launch]:
    """Every launch in the order they run: the scaling stage, then the equivalence stage (what --budget cuts
    first); in a stage, sizes in ``run_order``, PyTorch (the reference, two configurations a size) before
    BluTrain; in a scaling launch, compiled before eager, modes in ``--modes`` order."""
    launches: list[Launch] = []
    most = max(a.sizes)
    shape = {"batch_size": a.batch_size, "seq_len": a.seq_len}
    # the same global batch on 1, 2 and G GPUs, whichever sizes the scaling stage runs
    equiv_sizes = [n for n in (1, 2, most) if most > 1 and most % n == 0]
    for stage in (s for s in STAGES if s in a.stages):
        for n in run_order(a.sizes if stage == "scaling" else equiv_sizes):
            for fw in sorted(a.frameworks, key=lambda f: f != "torch"):
                launch = Launch(stage, fw, n)
                if stage == "scaling":
                    for impl in sorted(a.impls, key=lambda i: i != "compiled"):
                        for mode in (["single"] if n == 1 else a.modes if fw == "blutrain" else a.torch_modes):
                            launch.configs.append(Config(
                                stage, f"{fw}-{impl}-{mode}-{n}gpu", fw, impl, mode, n, a.precision, steps=a.steps,
                                warmup=a.warmup, profile_steps=a.profile_steps if a.profile else 0,
                                **shape))
                else:  # the global batch of the largest size: 1 GPU accumulates it, N GPUs share it
                    impl = "compiled" if fw == "blutrain" else "eager"
                    fp32 = fw == "blutrain" and a.precision != "fp32" and n in (1, most)
                    for prec in [a.precision] + (["fp32"] if fp32 else []):
                        # BluTrain's fp32 rows on N GPUs: the default all-reduce, then the rank-ordered reduction
                        ordered = fw == "blutrain" and prec == "fp32" and n > 1
                        for mode in ["single"] if n == 1 else ["ddp", "ddp-ordered"] if ordered else ["ddp"]:
                            tag = "-ordered" if mode == "ddp-ordered" else ""
                            launch.configs.append(Config(
                                stage, f"equiv-{fw}-{prec}{tag}-{n}gpu", fw, impl, mode, n, prec,
                                steps=a.equiv_steps, warmup=0, accum=most // n, lr_warmup=a.equiv_lr_warmup,
                                **shape))
                if launch.configs:
                    launches.append(launch)
    return launches


def launch_command(launch: Launch, job_path: Path, collective_timeout: float) -> list[str]:
    """BluTrain's ranks through ``blutrain run`` (a rank that fails stops the others; its collectives time
    out below the configuration's limit); PyTorch's through torchrun."""
    if launch.framework == "blutrain":
        return [sys.executable, "-m", "blutrain.cli", "run", "-n", str(launch.gpus), "--grace", "3", "--timeout",
                f"{collective_timeout:.0f}", "--", str(SCRIPT), "--worker", str(job_path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(launch.gpus),
            str(SCRIPT), "--worker", str(job_path)]


def child_env() -> dict[str, str]:
    """The launches' environment: this process's import path as PYTHONPATH, so every rank imports what this
    process imports; and NCCL's set-up log (unless NCCL_DEBUG is set), so each row says which transport its
    communicators took (BluTrain's NCCL, CuPy's, and PyTorch's are separate libraries)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    if "NCCL_DEBUG" not in env:
        env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"] = "INFO", "INIT,GRAPH"
    return env


def nccl_summary(log: str) -> str | None:
    """``NCCL <version>: <n> × <transport>, ...`` from NCCL's INFO lines in a launch's log; None when NCCL
    logged nothing."""
    versions = sorted(set(re.findall(r"NCCL version (\S+)", log)))
    transports = Counter(re.findall(r"Channel \d+/\d+ : .* via (\S+)", log))
    if not versions and not transports:
        return None
    via = ", ".join(f"{count} × {name}" for name, count in transports.most_common()) or "no channel lines"
    return f"NCCL {' and '.join(versions) or '(version not logged)'}: {via}"


def log_error(log: Path) -> str:
    """The launch's error as its log tells it: the last line naming an error, else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "exited with code" in line or "killed by" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the launcher's process group (both launchers pass it on to their ranks), SIGKILL after a
    grace period."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def read_ranks(folder: Path) -> list[dict[str, Any]]:
    ranks = []
    for path in sorted(folder.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            ranks.append(json.loads(path.read_text()))
    return ranks


def settle(rows: Sequence[Row], ranks: Sequence[dict[str, Any]], why_stopped: str | None, log: Path) -> list[Row]:
    """Fill ``rows`` (a launch's, in order) from its ranks' reports; return the rows it did not reach, to
    launch again. The first row that no rank finished, or that a rank failed, ends the launch: it gets the
    launch's error (``why_stopped``: the bench stopped it; else the log's). A set-up that failed before any
    configuration (a process group, an import) is every row's error: launching again would fail the same way."""
    setup = next((r["error"] for r in ranks if r.get("error")), None)
    for i, row in enumerate(rows):
        name = row.config.name
        entries = [r["configs"][name] for r in ranks if name in r.get("configs", {})]
        finished = len(entries) >= row.config.gpus and all(e.get("status") in ("ok", "skipped") for e in entries)
        if finished or any(e.get("error") for e in entries):
            collect(row, entries)
            if row.status in ("ok", "skipped"):
                continue
            return list(rows[i + 1:])
        if i == 0 and not entries and setup and not why_stopped:
            for r in rows:
                r.status, r.error = "error", f"set-up: {setup}"
            return []
        collect(row, entries)
        where = "; ".join(f"rank {e.get('rank')} in {e.get('phase')}" for e in entries)
        row.status = "timeout" if why_stopped else "error"
        row.error = "; ".join(x for x in (why_stopped or (f"set-up: {setup}" if setup else log_error(log)), where)
                              if x)
        return list(rows[i + 1:])
    return []


# -- the bench ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.result: dict[str, Any] = {}
        self.env = child_env()
        self.nsys: list[str] | None = None  # the profiled rank's command prefix; None: no nsys profile
        self.trace = False  # rank 0 profiles under torch.profiler (--profiler torch)

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.notes.append(text)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stamp(self, text: str) -> None:
        print(f"== [{self.elapsed():5.0f} s] {text}", flush=True)

    def over_budget(self) -> bool:
        return bool(self.args.budget) and self.elapsed() >= self.args.budget

    # -- set-up ----------------------------------------------------------------------------------------
    def data_source(self) -> tuple[str | None, str, int]:
        """(the trainer's --data, the train shards' pattern, the vocabulary), built once here so that the
        ranks do not race to build the stdlib corpus."""
        from blutrain.train import TrainConfig
        from blutrain.train.trainer import resolve_data

        data = resolve_data(TrainConfig(data=self.args.data))
        return self.args.data, data.train_pattern, data.vocab_size

    def profiler_prefix(self) -> None:
        a = self.args
        if not a.profile:
            return
        if a.device != "cuda":
            self.note("--profile: kernels are profiled on cuda only; the comm columns stay '-'")
            return
        kind = a.profiler or ("torch" if importlib.util.find_spec("torch") is not None else "nsys")
        if kind == "torch":
            self.trace = True
            self.note("--profile: rank 0's profiled steps run under torch.profiler (CUPTI: every kernel of the "
                      "process, those inside CUDA graphs one by one); a Chrome trace per configuration in runs/")
            return
        nsys = nsys_path()
        if nsys is None:
            self.note("--profile: nsys is not on PATH; the comm columns stay '-'")
            return
        nodes = nsys_graph_node_tracing(nsys)
        if not nodes:
            self.note("--profile: this nsys cannot trace the kernels inside CUDA graphs (--cuda-graph-trace): the "
                      "compiled rows' comm columns count each graph launch as one non-NCCL kernel")
        self.nsys = nsys_command(nsys, Path("REPORT"), nodes)
        self.note(f"--profile: rank 0 of each multi-GPU scaling launch runs under {nsys} for the whole launch (it "
                  "captures only the profiled steps, but watches the CUDA API throughout): to check that it costs "
                  "the timed steps nothing, compare their step ms with a run without --profile")

    # -- launches --------------------------------------------------------------------------------------
    def run_launch(self, launch: Launch, data: tuple[str | None, str, int], overrides: dict[str, Any]) -> None:
        rows = [Row(c) for c in launch.configs]
        self.rows.extend(rows)
        pending, attempt, profiled = rows, 0, self.nsys is not None or self.trace
        while pending:
            if self.over_budget():
                for row in pending:
                    row.status, row.error = "skipped", f"the --budget of {self.args.budget:g} s was spent"
                self.note(f"{launch.name}: {len(pending)} configuration(s) skipped: over --budget")
                return
            if launch.gpus > self.args.gpus_found:
                for row in pending:
                    row.status, row.error = "skipped", f"needs {launch.gpus} GPUs, {self.args.gpus_found} found"
                return
            attempt += 1
            left, stopped, rank0_ran = self.attempt(launch, pending, attempt, data, overrides, profiled)
            if profiled and not rank0_ran and not stopped:
                # rank 0 never reported under nsys: nsys may be what failed; once more without it
                self.note(f"{launch.name}: rank 0 did not start under nsys ({pending[0].error}); again without "
                          "--profile")
                for row in pending:
                    row.status, row.error = "not run", None
                profiled = False
                continue
            pending = left

    def attempt(self, launch: Launch, rows: list[Row], attempt: int, data: tuple[str | None, str, int],
                overrides: dict[str, Any], profiled: bool) -> tuple[list[Row], str | None, bool]:
        """One launch of ``rows``' configurations; returns those it did not reach, why it was stopped, and
        whether rank 0 reported at all."""
        a = self.args
        where = self.out / "runs" / f"{launch.name}-{attempt}"
        where.mkdir(parents=True, exist_ok=True)
        for old in where.glob("rank*.json"):
            old.unlink()
        profile_dir = where / "profile"
        nsys_prefix = None
        traced = profiled and self.trace and any(r.config.profile_steps for r in rows)
        if profiled and self.nsys is not None and any(r.config.profile_steps for r in rows):
            profile_dir.mkdir(exist_ok=True)
            nsys_prefix = [str(profile_dir / f"{launch.name}-rank0") if x == "REPORT" else x for x in self.nsys]
        if traced:
            profile_dir.mkdir(exist_ok=True)
        job = {"framework": launch.framework, "gpus": launch.gpus, "device": a.device, "model": a.model,
               "preset": a.preset,
               "data": data[0], "train_pattern": data[1], "vocab_size": data[2], "seed": a.seed,
               "configs": [asdict(r.config) for r in rows], "overrides": overrides,
               "deadline": self.wall0 + a.budget if a.budget else None, "nsys_prefix": nsys_prefix,
               "trace_dir": str(profile_dir) if traced else None}
        job_path = where / "job.json"
        job_path.write_text(json.dumps(job, indent=1))
        cmd = launch_command(launch, job_path, max(30.0, a.config_timeout - 15.0))
        log = where / "launch.log"
        self.stamp(f"{launch.name} (attempt {attempt}): {', '.join(r.config.name for r in rows)}"
                   + (" — rank 0 under nsys" if nsys_prefix else ""))
        started: dict[str, float] = {}
        why: str | None = None
        with open(log, "wb") as f:
            f.write(("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n").encode())
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                    start_new_session=True)
            t_start = time.monotonic()
            done_at: float | None = None
            while proc.poll() is None:
                time.sleep(0.5)
                ranks = read_ranks(where)
                now = time.monotonic()
                for r in ranks:
                    if r.get("current") and r["current"] not in started:
                        started[r["current"]] = now
                current = max(started, key=lambda k: started[k]) if started else None
                since = started[current] if current else t_start
                finished = all(len([r for r in ranks if name in r.get("configs", {})
                                    and r["configs"][name].get("status") in ("ok", "skipped", "error")])
                               >= launch.gpus for name in (x.config.name for x in rows))
                if finished:
                    done_at = done_at or now
                    if now - done_at > EXIT_GRACE_S:
                        why = f"the ranks did not exit within {EXIT_GRACE_S:g} s of their last result"
                elif now - since > a.config_timeout:
                    why = f"killed after {a.config_timeout:g} s in {current or 'the set-up'}"
                elif a.budget and self.elapsed() > a.budget + BUDGET_GRACE_S:
                    why = (f"killed in {current or 'the set-up'}: {BUDGET_GRACE_S:g} s past the --budget of "
                           f"{a.budget:g} s")
                if why:
                    stop(proc)
                    break
        ranks = read_ranks(where)
        rank0_ran = any(r.get("rank") == 0 for r in ranks)
        if why and why.startswith("the ranks did not exit"):
            self.note(f"{launch.name}: {why} (the results were in)")
            why = None
        left = settle(rows, ranks, why, log)
        order = sorted(started, key=lambda k: started[k])
        for i, name in enumerate(order):
            end = started[order[i + 1]] if i + 1 < len(order) else time.monotonic()
            for row in rows:
                if row.config.name == name:
                    row.wall_s = round(end - started[name], 1)
        if launch.gpus > 1 and a.device == "cuda":
            with contextlib.suppress(OSError):
                summary = nccl_summary(log.read_text(errors="replace"))
                for row in rows:
                    row.nccl = row.nccl or summary
        if nsys_prefix:
            self.read_profiles(rows, profile_dir)
        if traced:
            self.read_traces(rows, profile_dir)
        reached = [r for r in rows if not any(r is x for x in left)]
        for row in reached:
            self.report(row)
        if any(r.status not in ("ok", "skipped") for r in reached):
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-20:]
                print(f"   log tail ({log}):\n" + "\n".join(f"   | {line}" for line in tail), flush=True)
        return left, why, rank0_ran

    def read_profiles(self, rows: list[Row], folder: Path) -> None:
        nsys = nsys_path()
        problems = export_missing(nsys, folder) if nsys else []
        steps = {r.config.name: r.config.profile_steps for r in rows if r.config.profile_steps}
        costs, more = costs_from_exports(sorted(folder.glob("*.sqlite")), steps)
        for row in rows:
            cost = costs.get(row.config.name)
            if cost is not None:
                row.comm_ms, row.exposed_ms = cost.comm_ms, cost.exposed_ms
            elif row.config.profile_steps and row.status == "ok" and not row.profile_note:
                row.profile_note = "no profile found" + (f" ({'; '.join(problems + more)[:200]})"
                                                         if problems or more else "")

    def read_traces(self, rows: list[Row], folder: Path) -> None:
        """Rank 0's torch.profiler traces: each profiled row's comm and exposed ms, and its top kernels printed."""
        steps = {r.config.name: r.config.profile_steps for r in rows if r.config.profile_steps}
        costs, tables, problems = costs_from_chrome_traces(sorted(folder.glob(f"*{TORCH_TRACE_SUFFIX}")), steps)
        for row in rows:
            cost = costs.get(row.config.name)
            if cost is not None:
                row.comm_ms, row.exposed_ms = cost.comm_ms, cost.exposed_ms
                row.kernels = [asdict(k) for k in tables[row.config.name]]
            elif row.config.profile_steps and row.status == "ok" and not row.profile_note:
                row.profile_note = "no trace found" + (f" ({'; '.join(problems)[:200]})" if problems else "")
        for row in rows:
            if row.kernels:
                busy = sum(k["ms"] for k in row.kernels if k["name"] != "(idle)")
                lines = [f"   {row.config.name}: top kernels per step (rank 0, {busy:.2f} ms busy):"]
                lines += [f"   {k['ms']:8.3f} ms {k['calls']:6.1f}×  {k['name']}" for k in row.kernels[:TOP_KERNELS]]
                idle = [k for k in row.kernels if k["name"] == "(idle)"]
                if idle and row.kernels.index(idle[0]) >= TOP_KERNELS:
                    lines.append(f"   {idle[0]['ms']:8.3f} ms          (idle)")
                print("\n".join(lines), flush=True)

    def report(self, row: Row) -> None:
        parts = [f"   {row.config.name}: {row.status}" + (f" in {row.wall_s:.0f} s" if row.wall_s else "")]
        if row.step_ms is not None and row.tokens_per_s is not None:
            parts.append(f"step {row.step_ms:.2f} ms, {row.tokens_per_s:,.0f} tok/s")
        if row.peak_allocated is not None:
            parts.append(f"peak allocated {row.peak_allocated / 2**30:.2f} GiB")
        if row.exposed_ms is not None:
            parts.append(f"comm {row.comm_ms:.2f} ms, exposed {row.exposed_ms:.2f} ms")
        if row.losses:
            parts.append(f"loss {row.losses[0]:.4f} → {row.losses[-1]:.4f}")
        print(", ".join(parts), flush=True)
        if row.error:
            print(f"     {row.error}", flush=True)

    # -- output ----------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        a = self.args
        meta: dict[str, Any] = {
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python " + " ".join(shlex.quote(x) for x in [
                os.path.relpath(sys.argv[0], ROOT) if Path(sys.argv[0]).is_absolute() else sys.argv[0],
                *sys.argv[1:]]),
            "device": a.device, "gpus": a.gpus, "sizes": a.sizes, "gpus_found": a.gpus_found, "model": a.model,
            "preset": a.preset,
            "python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "cuda_allocator": os.environ.get("BLUTRAIN_CUDA_ALLOCATOR", "blutrain"),
        }
        for dist_name in ("torch", "cupy-cuda13x", "cupy-cuda12x"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                meta[dist_name.split("-")[0]] = importlib.metadata.version(dist_name)
        if os.environ.get("BLUTRAIN_COMMIT"):
            meta["git"] = os.environ["BLUTRAIN_COMMIT"]
        elif (ROOT / ".git").exists():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=10)
                dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=10)
                meta["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if a.device == "cuda":
            meta["gpu_names"] = gpu_names()
            meta["gpu"] = meta["gpu_names"][0] if meta["gpu_names"] else None
            for key, cmd in (("nvidia_smi", ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                             "--format=csv,noheader"]),
                             ("nvidia_topology", ["nvidia-smi", "topo", "-m"])):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    meta[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        else:
            with contextlib.suppress(OSError):
                for line in Path("/proc/cpuinfo").read_text().splitlines():
                    if line.startswith("model name"):
                        meta["cpu"] = line.split(":", 1)[1].strip()
                        break
        return meta

    def save(self) -> None:
        fill_efficiencies(self.rows)
        fill_loss_differences(self.rows)
        self.result["rows"] = [asdict(r) for r in self.rows]
        self.result["goals"] = goals(self.rows)
        self.result["notes"] = self.notes
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        path = self.out / "bench_dist.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(tmp, path)

    def run(self) -> int:
        a = self.args
        self.result["meta"] = self.metadata()
        print(f"distributed benchmark: {a.device}, sizes {a.sizes} of {a.gpus_found} found; stages "
              f"{','.join(a.stages)}; frameworks {','.join(a.frameworks)}; impls {','.join(a.impls)}; out {self.out}",
              flush=True)
        data = self.data_source()
        overrides = {"vocab_size": data[2]} if a.preset == "tiny" else {}  # as the trainer sizes the tiny model
        self.profiler_prefix()
        launches = plan(a)
        for launch in launches:
            if launch.framework == "torch" and importlib.util.find_spec("torch") is None:
                self.rows.extend(Row(c, status="skipped", error="PyTorch is not installed") for c in launch.configs)
                continue
            self.run_launch(launch, data, overrides)
            self.save()
        self.note("step: wall time of a whole step including its host read of the loss, slowest rank, median; "
                  "efficiency against the same framework and implementation on 1 GPU")
        if "torch" in a.frameworks and {"tp", "tp-async"} & set(a.torch_modes):
            self.note("torch tp: parallelize_module over every rank (Megatron layout: q/k/v and fc colwise, "
                      "projections rowwise, embedding and head vocab-parallel and tied, loss_parallel, LayerNorms "
                      "replicated); tp-async: the same sequence-parallel, inductor's micro-pipeline TP pass on, "
                      "compiled and cuda only")
        if "torch" in a.frameworks and "fsdp2" in a.torch_modes and "compiled" in a.impls:
            self.note("torch compiled fsdp2 compiles each transformer block before sharding it (embedding, head and "
                      "loss run eagerly); its 1-GPU baseline, like the DDP rows, compiles the whole model")
        self.save()
        why = chart(self.rows, self.result["meta"], self.out / "bench_dist.png")
        if why:
            self.note(why)
        text = format_table(self.rows, self.result["meta"])
        (self.out / "bench_dist.txt").write_text(text + "\n")
        print(f"\nwrote {self.out / 'bench_dist.json'}, bench_dist.txt, bench_dist.png and runs/ in "
              f"{self.elapsed():.0f} s\n")
        print(text)
        return 0 if all(r.status in ("ok", "skipped") for r in self.rows) else 1


def parse_args(argv: list[str] | None = None, gpus_found: Callable[[], int] | None = None) -> argparse.Namespace:
    """The options (tools/bench/dist_options.py), with the device's and the model family's defaults filled in;
    ``gpus_found`` counts the visible GPUs (cuda)."""
    return options.parse_args(argv, gpus_found, description=__doc__ or "")


def main(argv: list[str] | None = None) -> int:
    measure_installed_plugins()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        if len(argv) != 2:
            raise SystemExit("usage: dist.py --worker JOB.json (the per-rank entry point of a launch)")
        from bench.dist_worker import worker

        return worker(Path(argv[1]))
    return Bench(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
