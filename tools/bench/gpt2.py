#!/usr/bin/env python3
"""GPT-2 training, BluTrain beside PyTorch in one process: throughput, MFU, peak memory, loss parity, profile.

Why this tool: a claim of speed or memory counts only when it is measured beside the baseline, in the same
run, on the same machine, with the same shapes and hyper-parameters (issue 6). Every later performance change
is judged by this table.

    python tools/bench/gpt2.py                        # GPU: gpt2-124m, T=1024, micro-batch 16; fp32, tf32, bf16
                                                      # × blutrain, torch, torch-compile (within 8 minutes)
    python tools/bench/gpt2.py --quick                # about 2 minutes: no torch.compile, fewer warm-up steps
    python tools/bench/gpt2.py --parity 200           # also: 200 steps of both from the same initial weights
    python tools/bench/gpt2.py --profile              # also: per-kernel table of one BluTrain step, NVTX ranges
    python tools/bench/gpt2.py --device cpu --quick   # CPU: tiny preset against PyTorch's CPU build
    python tools/bench/gpt2.py --model llama --preset llama-1b --seq-len 2048 --batch-size 4 --precision bf16 \
        --impl blutrain,blutrain-compile,torch,torch-compile    # issue 25's one-GPU row: sequential turns
    python tools/bench/gpt2.py ... --impl blutrain-compile,torch-compile --remat    # the compiled step with the
                                                      # rematerialize pass (--no-remat: without; default: as compiled)
    python tools/bench/gpt2.py ... --remat --compile-replace rematerialize=rematerialize-activations  # activations only

What is compared
- BluTrain: ``blutrain.models.gpt2.GPT2``, the ``adamw`` optimizer plugin, ``clip_grad_norm_``, eager.
  BluTrain compiled (``--impl blutrain-compile``): the same step (forward, backward, clip, AdamW, zero_grad)
  through ``blutrain.compiler.compile``; its first call runs eagerly, the second traces, the rest replay.
  ``--remat`` / ``--no-remat`` compile it with or without the ``rematerialize`` pass (meta's ``hyper.remat``).
- ``--model llama`` (the blutrain-model-llama plugin): BluTrain's Llama against ``torch_llama_reference``
  (LlamaForCausalLM written plainly with ``nn.RMSNorm``, SDPA with ``enable_gqa``: torch >= 2.5), the same
  names, initialisation and hyper-parameters; everything below applies to it as to GPT-2.
- PyTorch: a reference written the way the seed paper's baseline is (nanoGPT style): stock ``nn.Linear``,
  ``nn.LayerNorm``, ``nn.Embedding``, ``F.scaled_dot_product_attention(is_causal=True)``, GELU-tanh, the LM
  head tied to the token embedding, ``torch.optim.AdamW`` (``fused=True`` where the build has it; the output
  says which), ``torch.nn.utils.clip_grad_norm_``; eager, and ``torch.compile`` of the model (the optimizer
  step stays eager, as in nanoGPT).
- Both: nanoGPT's initialisation and decay groups (weight decay on tensors of two or more dims), AdamW
  lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0, constant learning rate, no dropout, the
  same batches (random tokens, or ``--data`` shards), the loss returned without keeping the logits alive.
- Precision: fp32 = float32 with TF32 off on both sides; tf32 = TF32 GEMMs on both
  (``torch.set_float32_matmul_precision("high")``, BluTrain's backend ``set_tf32``); bf16 = autocast with
  float32 master weights (``blutrain.amp.autocast`` and ``torch.autocast``).

How it is measured
- Precisions run one after another; within a precision every implementation is built and warmed up, then
  they take turns step by step (the first of each round rotates), so clock and thermal drift hit all alike.
  ``--turns sequential`` (auto on cuda when the implementations' float32 weights, gradients and AdamW moments
  would fill more than a third of the GPU together, as a 1B-parameter model's do): each implementation is built,
  warmed up, timed and freed before the next, compiled ones before eager ones (under auto, after the first,
  which is built to count the parameters).
- Step time: CUDA events around the whole step (zero_grad, forward, backward, clip, optimizer) on each
  framework's current stream, synchronised after each step; the median of ``--steps`` (>= 20) timed steps.
  Host ms is the time until the step's Python call returns (launch cost; equals the step when it blocks).
- MFU: FLOPs per token = 6·N + 12·L·H·Q·T (nanoGPT / PaLM appendix B: N parameters without the position
  embedding, L layers, H heads, Q head size, T sequence length; causal masking not discounted; another family:
  its model's declared ``flops_per_token``, read from the run's first BluTrain model), times tokens/s,
  over a peak: the GEMM ceiling measured at the start (8192³ torch.matmul in the mode's dtype) and, in the
  ``MFU spec`` column, NVIDIA's dense datasheet peak when the GPU is an H100 or H200.
- Memory, per configuration, above what the process held before it was built: PyTorch's
  ``max_memory_allocated`` over one steady step and ``max_memory_reserved`` over its life; BluTrain's the same
  two numbers from its caching allocator (blutrain-alloc) when the cuda backend uses it, else CuPy's memory
  pool measured exactly by a ``cupy.cuda.MemoryHook`` (live bytes at every malloc/free; pool bytes).
- ``--parity N``: PyTorch's initial weights are copied into BluTrain, both train N steps on the same batches
  (fp32, micro-batch 8 on the GPU unless told otherwise); max |Δloss| and both curves (parity.png).
- ``--time-limit``: stages (a precision; in sequential turns each implementation too) that would start after
  it are skipped with a note, so a run ends with its table.
- ``--profile``: for one precision, per-phase GPU and host time (events and the host clock at the phase
  boundaries), then one step under ``torch.profiler`` (CUPTI sees CuPy's kernels too) with NVTX ranges per
  phase and per module (blocks, attn, mlp, ln_*, embeddings, lm_head; not the linears inside attn and mlp, whose
  hooks would take BluTrain's MLP off its fused path): a per-kernel table (name, calls, total ms, share) for
  BluTrain and for PyTorch eager, and the busy time against the step's span (the rest is the GPU waiting).

Writes to ``--out`` (default $OUT when set, else tools/results/bench_gpt2): bench_gpt2.json (everything,
rewritten after each stage so a killed run keeps what it finished), bench_gpt2.png, bench_gpt2.txt (the
final table), parity.png, profile_*.trace.json.gz (Chrome/Perfetto traces). The table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: this file's siblings import as bench.*
from bench.arguments import choice_list, measure_installed_plugins
from bench.gpt2_measure import (
    GIB,
    Meter,
    StageTimeoutError,
    blutrain_meter,
    check_finite,
    counted_non_embedding_params,
    error_text,
    flops_per_token,
    fmt_count,
    fmt_gib,
    fmt_pct,
    fmt_ratio,
    free_device_caches,
    gemm_ceilings,
    non_embedding_params,
    pyplot,
    quantile,
    ratio,
    resident_training_bytes,
    spec_peaks,
    stage_deadline,
    torch_meter,
)
from bench.gpt2_models import (
    BUILTIN_DATA,
    TORCH_MODELS,
    Batches,
    BluTrainCompiledRunner,
    BluTrainRunner,
    Hyper,
    Runner,
    build_runner,
    close_runner,
    compile_pipeline,
    describe_data,
    set_precision,
)
from bench.gpt2_parity import ParityStage
from bench.gpt2_profile import ProfileStages

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("fp32", "tf32", "bf16")
IMPLS = ("blutrain", "blutrain-compile", "torch", "torch-compile")
# NVIDIA datasheet peaks in TFLOP/s, dense (the tensor-core figures there are with 2:4 sparsity: halved here).
GOALS = (  # issue 6's goals, reported against, never asserted
    ("fp32", "tokens/s ≥ 1.08 × torch eager", "torch", "speed", 1.08),
    ("bf16", "tokens/s ≥ 1.10 × torch.compile", "torch-compile", "speed", 1.10),
    ("fp32", "peak allocated ≤ 0.6 × torch eager", "torch", "alloc", 0.6),
)
@dataclass
class Row:
    """One configuration's result; memory in bytes above the process's holdings before it was built."""

    precision: str
    impl: str
    steps: int = 0
    step_ms: float | None = None
    step_ms_p10: float | None = None
    step_ms_p90: float | None = None
    host_ms: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_spec: float | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    memory_source: str | None = None
    losses: list[float] = field(default_factory=list)
    error: str | None = None
    # blutrain-compile: the compiled graph's CompileStats after warm-up (its planned arena, the values recomputed)
    compile_stats: dict[str, Any] | None = None


# -- the bench ---------------------------------------------------------------------------------------------
class Bench(ParityStage, ProfileStages):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.device: str = args.device
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        from blutrain.models import model_spec

        self.cfg: Any = model_spec(args.model).config(args.preset)
        self.hp = Hyper(lr=args.lr, clip=args.clip, seed=args.seed,
                        compile_passes=compile_pipeline(args.compile_replace, args.remat), remat=args.remat,
                        model=args.model)
        self.tokens = args.batch_size * args.seq_len
        # GPT-2: nanoGPT's closed form. Another family: its model's declared flops_per_token, read from the first
        # BluTrain model this run builds (``count_flops``): no extra copy of a large model just to count it.
        self.non_embedding: int | None = None
        self.fpt: float | None = None
        self.flops_formula = "the model's declared flops_per_token (Model.flops_per_token)"
        if args.model == "gpt2":
            self.non_embedding = non_embedding_params(self.cfg)
            self.fpt = flops_per_token(self.cfg, args.seq_len, self.non_embedding)
            self.flops_formula = "6*N + 12*L*H*Q*T (N without position embedding)"
        # the implementations' turns: --turns, or for auto chosen at the first build (``choose_turns``)
        self.sequential: bool | None = None if args.turns == "auto" else args.turns == "sequential"
        self.notes: list[str] = []
        self.rows: list[Row] = []
        self.result: dict[str, Any] = {}
        self.have_torch = True
        try:
            import torch  # noqa: F401
        except ImportError:
            self.have_torch = False
            self.note("PyTorch is not installed (pip install torch==2.13.0 beside BluTrain): BluTrain rows only")
        self.impls = [i for i in args.impl if i in IMPLS and (i.startswith("blutrain") or self.have_torch)]
        self.peaks: dict[str, float] = {}
        self.spec_name: str | None = None
        self.spec: dict[str, float] = {}
        self.optimizers: dict[str, str] = {}

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.notes.append(text)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def out_of_time(self) -> bool:
        return bool(self.args.time_limit) and self.elapsed() > self.args.time_limit

    def stamp(self, text: str) -> None:
        print(f"== [{self.elapsed():5.0f} s] {text}", flush=True)

    # -- metadata and output ---------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        a = self.args
        meta: dict[str, Any] = {
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python " + " ".join(shlex.quote(x) for x in [
                os.path.relpath(sys.argv[0], ROOT) if Path(sys.argv[0]).is_absolute() else sys.argv[0],
                *sys.argv[1:]]),
            "device": self.device, "preset": a.preset, "batch_size": a.batch_size, "seq_len": a.seq_len,
            "tokens_per_step": self.tokens, "timed_steps": a.steps, "warmup_steps": a.warmup,
            "precisions": a.precision, "impls": self.impls, "data": describe_data(a.data, self.cfg.vocab_size),
            "hyper": asdict(self.hp), "fp32_gemm": a.fp32_gemm, "python": sys.version.split()[0],
            "numpy": np.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "non_embedding_params": self.non_embedding, "model": a.model,
            "flops_per_token": self.fpt, "flops_formula": self.flops_formula, "turns": a.turns,
            "gemm_ceiling_tflops": self.peaks, "spec_peak_name": self.spec_name, "spec_peak_tflops": self.spec,
            "optimizers": self.optimizers,
        }
        if os.environ.get("BLUTRAIN_COMMIT"):  # a tree exported without .git (git archive) names its commit here
            meta["git"] = os.environ["BLUTRAIN_COMMIT"]
        elif (ROOT / ".git").exists():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=10)
                dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=10)
                meta["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if self.have_torch:
            import torch

            meta["torch"] = torch.__version__
            meta["torch_threads"] = torch.get_num_threads()
            meta["torch_cuda"] = torch.version.cuda
        if self.device == "cuda":
            import cupy

            meta["cupy"] = cupy.__version__
            props = cupy.cuda.runtime.getDeviceProperties(0)
            meta["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            meta["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            meta["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
            with contextlib.suppress(Exception):
                smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                      "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
                meta["nvidia_smi"] = smi.stdout.strip().splitlines()[0]
        else:
            with contextlib.suppress(OSError):
                for line in Path("/proc/cpuinfo").read_text().splitlines():
                    if line.startswith("model name"):
                        meta["cpu"] = line.split(":", 1)[1].strip()
                        break
        return meta

    def save(self) -> None:
        self.result["rows"] = [asdict(r) for r in self.rows]
        self.result["ratios"] = self.ratios()
        self.result["notes"] = self.notes
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        path = self.out / "bench_gpt2.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(tmp, path)

    def row(self, precision: str, impl: str) -> Row | None:
        return next((r for r in self.rows if r.precision == precision and r.impl == impl and not r.error), None)

    def ratios(self) -> dict[str, dict[str, float | None]]:
        """BluTrain over each PyTorch row of the same precision: tokens/s, peak allocated, peak reserved."""
        out: dict[str, dict[str, float | None]] = {}
        for prec, mine in itertools.product(PRECISIONS, ("blutrain", "blutrain-compile")):
            ours = self.row(prec, mine)
            if ours is None:
                continue
            for impl in ("torch", "torch-compile"):
                ref = self.row(prec, impl)
                if ref is None:
                    continue
                out[f"{prec} {mine}/{impl}"] = {
                    "tokens_per_s": ratio(ours.tokens_per_s, ref.tokens_per_s),
                    "peak_allocated": ratio(ours.peak_allocated, ref.peak_allocated),
                    "peak_reserved": ratio(ours.peak_reserved, ref.peak_reserved)}
        return out

    # -- stages ----------------------------------------------------------------------------------------
    def ceilings(self) -> None:
        if not self.have_torch:
            return
        self.stamp("GEMM ceilings (torch.matmul, " + ("8192³" if self.device == "cuda" else "1024³") + ")")
        self.peaks = gemm_ceilings(self.device, self.args.precision)
        if self.device == "cuda":
            self.spec_name, self.spec = spec_peaks(self.result["meta"].get("gpu", ""))
        print("   " + ", ".join(f"{k} {v:,.1f} TFLOP/s" if v >= 1 else f"{k} {v:.3g} TFLOP/s"
                                for k, v in self.peaks.items())
              + (f"; datasheet {self.spec_name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in self.spec.items())
                 if self.spec else "; no datasheet peak for this device (MFU spec column empty)"), flush=True)
        self.result["meta"]["gemm_ceiling_tflops"] = self.peaks
        self.result["meta"]["spec_peak_name"] = self.spec_name
        self.result["meta"]["spec_peak_tflops"] = self.spec

    def count_flops(self, net: Any) -> None:
        """FLOPs per token (the model's declared ``flops_per_token``) and the parameters outside embeddings of
        a family other than GPT-2, from a BluTrain model of this run's config; once."""
        if self.fpt is not None:
            return
        self.non_embedding = counted_non_embedding_params(net)
        self.fpt = float(net.flops_per_token(self.args.seq_len))
        self.result["meta"].update(non_embedding_params=self.non_embedding, flops_per_token=self.fpt)

    def meter(self, impl: str) -> Meter:
        if self.device != "cuda":
            return Meter()
        return blutrain_meter() if impl.startswith("blutrain") else torch_meter()

    def precision_stage(self, precision: str, batches: list[Any]) -> None:
        """Build and warm up every implementation in this precision, then time them in turns; or, in
        sequential turns (``choose_turns``), each alone: built, warmed up, timed and freed before the next.
        Returns with nothing of them referenced, so the caller can give their memory back."""
        set_precision(precision, self.device, self.have_torch)
        runners: list[tuple[Runner, list[Any], Row]] = []
        pending = self.stage_order(self.impls)
        while pending:
            impl = pending.pop(0)
            if self.sequential and self.out_of_time():
                self.note(f"{precision} {impl}: skipped, past --time-limit {self.args.time_limit} s")
                continue
            self.stamp(f"{precision}: build and warm up {impl}")
            row = Row(precision, impl)
            self.rows.append(row)
            ready = self.prepare(row, batches)
            if ready is None:
                continue
            if self.sequential is None:
                self.sequential = self.choose_turns(ready[0])
                pending = self.stage_order(pending)
            if self.sequential:
                self.stamp(f"{precision}: {self.args.steps} timed steps of {impl} alone")
                try:
                    with stage_deadline(self.args.stage_timeout, f"{impl}'s timed steps"):
                        self.alternate([(*ready, row)])
                except StageTimeoutError as exc:  # between two steps, outside alternate()'s own handling
                    row.error = error_text(exc)
                close_runner(ready[0])
                del ready
                free_device_caches(self.device, compiled=impl == "torch-compile")
                self.save()  # a call that ends early keeps every implementation timed so far
            else:
                runners.append((*ready, row))
        if runners:
            self.stamp(f"{precision}: {self.args.steps} timed steps each, alternating")
            self.alternate(runners)
        for runner, _, _ in runners:
            close_runner(runner)

    def stage_order(self, impls: list[str]) -> list[str]:
        """``impls`` in --impl order; in sequential turns the compiled ones first (the issue's comparison), so
        that what --time-limit cuts is the eager rows (under auto, turns are chosen at the first build: until
        then the order is --impl's)."""
        if not self.sequential:
            return list(impls)
        return sorted(impls, key=lambda impl: not impl.endswith("-compile"))

    def choose_turns(self, runner: Runner) -> bool:
        """(--turns auto) Sequential turns on cuda when every implementation's weights, gradients and AdamW
        moments together (16 bytes a parameter each) would take more than a third of the GPU: alternating steps
        needs them all resident at once, and each one's activations and cached blocks beside them, which a
        1B-parameter model's four implementations do not fit in 80 GB."""
        if self.device != "cuda":
            return False
        import cupy

        params = sum(int(p.numel()) for p in runner.params)
        resident = resident_training_bytes(params) * len(self.impls)
        total = int(cupy.cuda.Device().mem_info[1])
        sequential = resident > total // 3  # the rest: each one's activations and cached blocks
        if sequential:
            self.note(f"turns: sequential: {len(self.impls)} implementations × {params / 1e9:.2f} B parameters × 16 "
                      f"bytes = {fmt_gib(resident)} GiB resident between steps, more than a third of the GPU's "
                      f"{fmt_gib(total)} GiB; each implementation is built, timed and freed alone (the compiled ones "
                      "next), and --time-limit skips those that would start after it")
        return sequential

    def prepare(self, row: Row, batches: list[Any]) -> tuple[Runner, list[Any]] | None:
        """A built runner with its staged batches after warm-up; its memory peaks measured on one more step."""
        a = self.args
        t_build = time.monotonic()
        meter = self.meter(row.impl)
        try:
            with stage_deadline(a.stage_timeout, f"{row.impl}'s build and warm-up"):
                row.memory_source = meter.source
                meter.baseline()
                runner = build_runner(row.impl, self.cfg, self.device, row.precision, self.hp)
                if isinstance(runner, BluTrainRunner):
                    self.count_flops(runner.model)
                self.optimizers[row.impl] = runner.optimizer
                staged = [runner.stage(x, y) for x, y in batches]
                for i in range(max(a.warmup, 1)):
                    check_finite(runner.loss_value(runner.step(staged[i % len(staged)])), row.impl, i)
                meter.begin()
                check_finite(runner.loss_value(runner.step(staged[a.warmup % len(staged)])), row.impl, a.warmup)
                row.peak_allocated, row.peak_reserved = meter.end()
                if isinstance(runner, BluTrainCompiledRunner):
                    row.compile_stats = asdict(runner.compiled.stats)
        except Exception as exc:
            with contextlib.suppress(Exception):
                meter.end()  # a memory hook left on would slow every later step
            row.error = error_text(exc)
            self.note(f"{row.precision} {row.impl}: failed while building/warming up: {row.error}")
            traceback.print_exc()
            return None
        mem = (f", peak allocated {fmt_gib(row.peak_allocated)}, reserved {fmt_gib(row.peak_reserved)} GiB"
               if row.peak_allocated is not None else "")
        print(f"   {row.impl}: ready in {time.monotonic() - t_build:.1f} s{mem}", flush=True)
        return runner, staged

    def alternate(self, runners: list[tuple[Runner, list[Any], Row]]) -> None:
        """Round i steps every runner once, starting at runner i mod n; each step timed on its own clock."""
        times: dict[str, list[tuple[float, float]]] = {r.impl: [] for _, _, r in runners}
        for i in range(self.args.steps):
            for j in range(len(runners)):
                runner, staged, row = runners[(i + j) % len(runners)]
                if row.error:
                    continue
                try:
                    clock = runner.clock
                    start = clock.mark()
                    t0 = time.perf_counter()
                    loss = runner.step(staged[i % len(staged)])
                    host = (time.perf_counter() - t0) * 1e3
                    ms = clock.ms(start, clock.mark())
                    row.losses.append(check_finite(runner.loss_value(loss), row.impl, i))
                    times[row.impl].append((ms, host))
                except Exception as exc:
                    row.error = error_text(exc)
                    self.note(f"{row.precision} {row.impl}: failed in timed step {i}: {row.error}")
                    traceback.print_exc()
        for _, _, row in runners:
            ts = times[row.impl]
            if not ts:
                continue
            step = [t for t, _ in ts]
            row.steps = len(ts)
            row.step_ms = statistics.median(step)
            row.step_ms_p10, row.step_ms_p90 = quantile(step, 0.1), quantile(step, 0.9)
            row.host_ms = statistics.median(h for _, h in ts)
            row.tokens_per_s = self.tokens / (row.step_ms * 1e-3)
            if self.fpt is not None:
                achieved = self.fpt * row.tokens_per_s / 1e12
                peak, spec = self.peaks.get(row.precision), self.spec.get(row.precision)
                row.mfu = achieved / peak if peak else None
                row.mfu_spec = achieved / spec if spec else None
            print(f"   {row.impl:<16} {row.step_ms:9.2f} ms  {row.tokens_per_s:12,.0f} tok/s  host "
                  f"{row.host_ms:8.2f} ms  (p10 {row.step_ms_p10:.2f}, p90 {row.step_ms_p90:.2f})", flush=True)

    # -- the end -----------------------------------------------------------------------------------------
    def table(self) -> str:
        a = self.args
        counted = f" ({self.non_embedding / 1e6:.2f} M params without embeddings)" if self.non_embedding else ""
        cfgtxt = (f"{a.model} {a.preset}{counted} on "
                  f"{self.result['meta'].get('gpu') or self.result['meta'].get('cpu') or self.device}, "
                  f"micro-batch {a.batch_size} × T {a.seq_len} = {self.tokens:,} tokens/step, median of "
                  f"{a.steps} timed steps")
        cuda = self.device == "cuda"
        head = (f"{'prec':<5} {'impl':<16} {'step ms':>9} {'host ms':>8} {'tokens/s':>11} {'×torch':>7} "
                f"{'×compile':>8} {'MFU':>6} {'MFU spec':>8}")
        if cuda:
            head += f" {'alloc GiB':>9} {'rsrv GiB':>9} {'alloc/torch':>11} {'rsrv/torch':>10}"
        lines = [cfgtxt, head, "-" * len(head)]
        for r in self.rows:
            if r.error or r.step_ms is None:
                lines.append(f"{r.precision:<5} {r.impl:<16} failed: {(r.error or 'no timed step')[:90]}")
                continue
            torch_row, comp_row = self.row(r.precision, "torch"), self.row(r.precision, "torch-compile")
            vs_torch = ratio(r.tokens_per_s, torch_row.tokens_per_s) if torch_row and r.impl != "torch" else None
            vs_comp = (ratio(r.tokens_per_s, comp_row.tokens_per_s) if comp_row and r.impl.startswith("blutrain")
                       else None)
            line = (f"{r.precision:<5} {r.impl:<16} {r.step_ms:>9.2f} {r.host_ms:>8.2f} {r.tokens_per_s:>11,.0f} "
                    f"{fmt_ratio(vs_torch):>7} {fmt_ratio(vs_comp):>8} {fmt_pct(r.mfu):>6} {fmt_pct(r.mfu_spec):>8}")
            if cuda:
                mine = r.impl != "torch" and torch_row is not None
                alloc = ratio(r.peak_allocated, torch_row.peak_allocated) if mine and torch_row else None
                reserved = ratio(r.peak_reserved, torch_row.peak_reserved) if mine and torch_row else None
                line += (f" {fmt_gib(r.peak_allocated):>9} {fmt_gib(r.peak_reserved):>9} "
                         f"{fmt_ratio(alloc):>11} {fmt_ratio(reserved):>10}")
            lines.append(line)
        goals = []
        for prec, text, ref, kind, bound in GOALS if cuda else ():
            ours, theirs = self.row(prec, "blutrain"), self.row(prec, ref)
            if ours is None or theirs is None:
                continue
            if kind == "speed":
                v = ratio(ours.tokens_per_s, theirs.tokens_per_s)
                ok = v is not None and v >= bound
            else:
                v = ratio(ours.peak_allocated, theirs.peak_allocated)
                ok = v is not None and v <= bound
            if v is not None:
                goals.append(f"goal {prec} {text}: {v:.2f}× — {'met' if ok else 'not met'}")
        p = self.result.get("parity")
        if p and p.get("max_abs_dloss") is not None:
            goals.append(f"loss parity {p['precision']}: max |Δloss| {p['max_abs_dloss']:.2e} over {p['steps']} steps "
                         f"(goal < 2e-3 in fp32)")
            c = p.get("compiled")
            if c and c.get("max_rel_dloss") is not None:
                how = "one CUDA graph launch per step" if c["ran_as_graph"] else "no CUDA graph"
                goals.append(f"compiled against eager {p['precision']}: max rel. |Δloss| {c['max_rel_dloss']:.2e} over "
                             f"{c['steps']} steps (goal < 1e-5 in fp32); {c['captures']} capture(s), "
                             f"{c['updates']} recapture(s); {how if self.device == 'cuda' else 'CPU launch list'}")
        return "\n".join(lines + (["", *goals] if goals else []))

    def chart(self) -> None:
        plt = pyplot()
        rows = [r for r in self.rows if r.tokens_per_s]
        if plt is None or not rows:
            return
        precs = [p for p in PRECISIONS if any(r.precision == p for r in rows)]
        impls = [i for i in IMPLS if any(r.impl == i for r in rows)]
        with_mem = self.device == "cuda" and any(r.peak_allocated for r in rows)
        fig, axes = plt.subplots(1, 2 if with_mem else 1, figsize=(12 if with_mem else 7, 4.5), squeeze=False)
        width = 0.8 / len(impls)
        colors = {"blutrain": "C0", "blutrain-compile": "C3", "torch": "C1", "torch-compile": "C2"}
        for k, impl in enumerate(impls):
            xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(precs))]
            tps = [(self.row(p, impl).tokens_per_s or 0) if self.row(p, impl) else 0 for p in precs]
            bars = axes[0][0].bar(xs, tps, width, label=impl, color=colors[impl])
            axes[0][0].bar_label(bars, labels=[fmt_count(v) for v in tps], fontsize=7)
            if with_mem:
                alloc = [(self.row(p, impl).peak_allocated or 0) / GIB if self.row(p, impl) else 0 for p in precs]
                rsrv = [(self.row(p, impl).peak_reserved or 0) / GIB if self.row(p, impl) else 0 for p in precs]
                axes[0][1].bar(xs, rsrv, width, color=colors[impl], alpha=0.3, hatch="//", edgecolor=colors[impl])
                axes[0][1].bar(xs, alloc, width, color=colors[impl], label=impl)
        axes[0][0].set_title(f"{self.args.model} {self.args.preset}, {self.tokens:,} tokens/step: tokens/s "
                             "(higher is better)", fontsize=9)
        axes[0][0].set_xticks(range(len(precs)), precs)
        axes[0][0].legend(fontsize=8)
        if with_mem:
            axes[0][1].set_title("peak memory, GiB: allocated (solid), reserved (hatched)", fontsize=9)
            axes[0][1].set_xticks(range(len(precs)), precs)
            axes[0][1].legend(fontsize=8)
        meta = self.result["meta"]
        fig.suptitle(f"{meta.get('gpu') or meta.get('cpu') or self.device}; torch {meta.get('torch', '-')}, "
                     f"cupy {meta.get('cupy', '-')}; {meta['date_utc']} UTC", fontsize=9)
        fig.tight_layout()
        fig.savefig(self.out / "bench_gpt2.png", dpi=120)
        plt.close(fig)

    def run(self) -> int:
        a = self.args
        if a.fp32_gemm != "cublas":
            if self.device != "cuda":
                raise SystemExit("--fp32-gemm is a cuda option")
            from blutrain_backend_cupy import set_fp32_gemm

            set_fp32_gemm(a.fp32_gemm)  # BluTrain's float32 GEMMs; PyTorch's stay strict cuBLAS
            self.note(f"BluTrain's float32 GEMMs (fp32 rows) run as {a.fp32_gemm}; PyTorch's as strict SGEMM")
        self.result["meta"] = self.metadata()
        print(f"{a.model} {a.preset} on {self.device}: precisions {','.join(a.precision)}; implementations "
              f"{','.join(self.impls)}; {a.steps} timed steps after {a.warmup} warm-up; "
              f"out {self.out}", flush=True)
        self.ceilings()
        self.save()
        if self.fpt is None and not any(impl.startswith("blutrain") for impl in self.impls):
            from blutrain.models import model_spec

            self.count_flops(model_spec(a.model).build(self.cfg))  # no BluTrain row: a CPU copy, counted
        batches = Batches(a.data, self.cfg.vocab_size, a.batch_size, a.seq_len, a.seed)
        staged = batches.take(min(max(a.steps, a.warmup + 1), 8))
        for precision in [] if a.no_throughput else a.precision:
            if precision == "tf32" and self.device == "cpu":
                self.note("tf32 is a GPU mode: skipped on the CPU")
                continue
            if self.out_of_time():
                self.note(f"{precision}: skipped, past --time-limit {a.time_limit} s")
                continue
            self.precision_stage(precision, staged)
            free_device_caches(self.device, compiled="torch-compile" in self.impls)
            self.save()
        if a.parity:
            if "blutrain" not in self.impls or not self.have_torch:
                self.note("parity needs both BluTrain and PyTorch")
            elif self.out_of_time():
                self.note(f"parity: skipped, past --time-limit {a.time_limit} s")
            else:
                pb = Batches(a.data, self.cfg.vocab_size, a.parity_batch_size, a.seq_len, a.seed + 1)
                try:
                    self.parity(a.parity, pb)
                except Exception as exc:
                    self.note(f"parity failed: {error_text(exc)}")
                    traceback.print_exc()
                free_device_caches(self.device)
                self.save()
        if a.profile:
            if self.out_of_time():
                self.note(f"profile: skipped, past --time-limit {a.time_limit} s")
            else:
                try:
                    self.profile(staged)
                except Exception as exc:
                    self.note(f"profile failed: {error_text(exc)}")
                    traceback.print_exc()
                free_device_caches(self.device)
                self.save()
        if a.host_profile:
            if self.out_of_time():
                self.note(f"host profile: skipped, past --time-limit {a.time_limit} s")
            else:
                try:
                    self.host_profile(staged)
                except Exception as exc:
                    self.note(f"host profile failed: {error_text(exc)}")
                    traceback.print_exc()
                self.save()
        for impl, text in self.optimizers.items():
            self.note(f"optimizer {impl}: {text}")
        if self.fpt is not None:
            formula = (f"6·N + 12·L·H·Q·T with N = {self.non_embedding:,} (no position embedding)"
                       if a.model == "gpt2" else f"{a.model}'s declared flops_per_token")
            self.note(f"FLOPs per token {self.fpt / 1e6:,.1f} M = {formula}, T = {a.seq_len}; MFU against the "
                      "measured GEMM ceiling of the mode" + (f", MFU spec against {self.spec_name} dense datasheet "
                                                             "peaks" if self.spec else ""))
        sources = sorted({r.memory_source for r in self.rows if r.memory_source and r.peak_allocated is not None})
        for s in sources:
            self.note(f"memory: {s}; above what the process held before the configuration was built")
        self.save()
        self.chart()
        text = self.table()
        (self.out / "bench_gpt2.txt").write_text(text + "\n")
        print(f"\nwrote {self.out / 'bench_gpt2.json'}, bench_gpt2.png, bench_gpt2.txt"
              + (", parity.png" if (self.out / "parity.png").exists() and a.parity else "")
              + (", profile_*.trace.json.gz" if a.profile else "") + f" in {self.elapsed():.0f} s\n")
        print(text)
        return 1 if any(r.error for r in self.rows) else 0


# -- small helpers -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="gpt2", help="a registered BluTrain model family (default gpt2); the PyTorch "
                                                    "implementations and --parity exist for gpt2 and llama, so another "
                                                    "family runs with --impl blutrain,blutrain-compile")
    ap.add_argument("--preset", help="the family's preset (default gpt2-124m on cuda, tiny on cpu)")
    ap.add_argument("--batch-size", type=int, default=16, help="micro-batch (default 16)")
    ap.add_argument("--seq-len", type=int, help="T (default 1024 on cuda, 128 on cpu; at most block_size)")
    ap.add_argument("--precision", type=choice_list(PRECISIONS), help="default fp32,tf32,bf16 (cuda), fp32 (cpu)")
    ap.add_argument("--impl", type=choice_list(IMPLS),
                    help="default blutrain,torch,torch-compile (cuda; no torch-compile with --quick), "
                         "blutrain,torch (cpu); blutrain-compile only when named")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default 20)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 3, 2 with --quick)")
    ap.add_argument("--data", help=f"a directory or glob of token shards (blutrain prepare), or {BUILTIN_DATA!r} for "
                                   "the built-in corpus of `blutrain train`; default random tokens")
    ap.add_argument("--fp32-gemm", choices=("cublas", "3xtf32"), default="cublas",
                    help="BluTrain's float32 GEMMs: strict cuBLAS SGEMM (default) or its 3xTF32 tensor-core kernel")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm clip (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parity", type=int, nargs="?", const=-1, default=0, metavar="N",
                    help="loss parity over N steps (default 200, 50 with --quick)")
    ap.add_argument("--parity-batch-size", type=int,
                    help="micro-batch of the parity run (default 8 on cuda, to fit the 8-minute budget; "
                         "--batch-size on cpu)")
    ap.add_argument("--parity-precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--parity-warmup", type=int, default=0, metavar="N",
                    help="linear learning-rate warm-up over N parity steps, both sides (default 0: constant lr)")
    ap.add_argument("--parity-floor", action="store_true",
                    help="also train PyTorch against itself (foreach AdamW and math attention): float32's own drift")
    ap.add_argument("--profile", action="store_true", help="per-kernel table of one step, phases, NVTX ranges")
    ap.add_argument("--no-throughput", action="store_true",
                    help="leave out the timed configurations (a run for --parity or --profile alone)")
    ap.add_argument("--profile-precision", choices=PRECISIONS, help="default: the first of --precision")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="cProfile N BluTrain steps (host time by function) at --profile-precision")
    ap.add_argument("--compile-replace", action="append", default=[], metavar="OLD=NEW",
                    help="blutrain-compile: the default pipeline with pass OLD replaced by NEW (repeatable), e.g. "
                         "layernorm-residual=layernorm-residual-linear-add")
    ap.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None,
                    help="blutrain-compile: with (--remat) or without (--no-remat) the compiler's rematerialize pass, "
                         "which makes cheap forward values (SwiGLU and norm outputs, bf16 weight copies) again "
                         "before their backward readers instead of holding them; default: the compiler's default "
                         "pipeline")
    ap.add_argument("--turns", choices=("auto", "alternate", "sequential"), default="auto",
                    help="alternate: every implementation built, then timed step by step in turns (drift hits all "
                         "alike); sequential: each built, timed and freed alone, compiled ones first; auto "
                         "(default): sequential on cuda when the implementations' weights, gradients and AdamW "
                         "moments (16 bytes a parameter each) would fill more than a third of the GPU, as "
                         "Llama-1B's do")
    ap.add_argument("--quick", action="store_true", help="a 2-minute subset")
    ap.add_argument("--time-limit", type=float,
                    help="seconds after which remaining stages are skipped; a stage is a precision, and in "
                         "sequential turns each implementation too (default 480 on cuda: a 600 s call keeps 120 s "
                         "for the stage that starts last, e.g. Llama-1B's eager PyTorch row; 120 with --quick; "
                         "none on cpu; 0: none)")
    ap.add_argument("--stage-timeout", type=float,
                    help="seconds an implementation's build and warm-up may take (compile included), and in "
                         "sequential turns its timed steps too; past it the implementation is a row with the "
                         "error and the bench goes on (default 180 on cuda: a 600 s call still reaches the other "
                         "three of four Llama-1B implementations when one compiles too long; none on cpu; 0: none). "
                         "The stop is an exception raised wherever the Python code is: one that lands in an import "
                         "can leave that module half-imported for the implementations after it")
    ap.add_argument("--out", help="output folder (default $OUT when set, else tools/results/bench_gpt2)")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    a.preset = a.preset or ("tiny" if cpu else "gpt2-124m")
    a.seq_len = a.seq_len or (128 if cpu else 1024)
    a.precision = a.precision or (["fp32"] if cpu else list(PRECISIONS))
    if a.model not in TORCH_MODELS:  # no PyTorch implementation of this family here
        a.impl = a.impl or (["blutrain"] if cpu else ["blutrain", "blutrain-compile"])
    a.impl = a.impl or (["blutrain", "torch"] if cpu or a.quick else ["blutrain", "torch", "torch-compile"])
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 3)
    if a.parity == -1:
        a.parity = 50 if a.quick else 200
    a.parity_batch_size = a.parity_batch_size or (a.batch_size if cpu else min(a.batch_size, 8))
    if a.time_limit is None:
        a.time_limit = 0 if cpu else (120 if a.quick else 480)
    if a.stage_timeout is None:
        a.stage_timeout = 0 if cpu else 180
    if a.stage_timeout < 0:
        ap.error(f"--stage-timeout must be >= 0 seconds (0: no limit), got {a.stage_timeout:g}")
    a.out = a.out or os.environ.get("OUT") or str(ROOT / "tools" / "results" / "bench_gpt2")
    for name in ("batch_size", "seq_len", "steps", "parity_batch_size"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.warmup < 0 or a.parity < 0:
        ap.error("--warmup and --parity must be >= 0")
    if a.steps < 20:
        print(f"note: --steps {a.steps}: issue 6 asks for the median of at least 20 timed steps", flush=True)
    return a


def main(argv: list[str] | None = None) -> int:
    measure_installed_plugins()
    args = parse_args(argv)
    from blutrain.models import models

    if args.model not in models():
        raise SystemExit(f"--model: no model {args.model!r}; installed: {models().describe()}")
    presets = models().get(args.model).presets
    if args.preset not in presets:
        raise SystemExit(f"--preset: unknown preset {args.preset!r} of {args.model}; expected one of "
                         f"{', '.join(presets)}")
    if args.seq_len > presets[args.preset]["block_size"]:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the preset's block_size "
                         f"{presets[args.preset]['block_size']}")
    torch_impls = [i for i in args.impl if i.startswith("torch")]
    if args.model not in TORCH_MODELS and (torch_impls or args.parity):
        raise SystemExit(f"--model {args.model}: this tool has PyTorch implementations of {', '.join(TORCH_MODELS)} "
                         "only; give --impl blutrain,blutrain-compile and no --parity")
    if args.device == "cuda":
        from blutrain_backend_cupy import cuda

        if not cuda.is_available():
            raise SystemExit("no usable GPU (blutrain_backend_cupy.cuda.is_available() is False): run on the GPU "
                             "machine, or pass --device cpu")
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
