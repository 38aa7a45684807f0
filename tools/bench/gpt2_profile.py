"""tools/bench/gpt2.py's profile stages (``--profile``, ``--host-profile``): per-phase device and host time, one
step under torch.profiler with NVTX ranges (a per-kernel table), cProfile of BluTrain's host path; a mixin of the
bench."""

from __future__ import annotations

import gzip
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.dist_profile import read_chrome_trace
from bench.gpt2_measure import PhaseRecorder, free_device_caches, nvtx_functions, sync_device
from bench.gpt2_models import BluTrainCompiledRunner, Runner, build_runner, set_precision


class ProfileStages:
    """The profile stages of :class:`bench.gpt2.Bench` (which holds the state these methods read)."""

    def profile(self, batches: list[Any]) -> None:
        a = self.args
        precision = a.profile_precision or a.precision[0]
        impls = [i for i in ("blutrain", "blutrain-compile", "torch", "torch-compile") if i in self.impls]
        self.stamp(f"profile: {precision}, {', '.join(impls)}, one step each after warm-up")
        set_precision(precision, self.device, self.have_torch)
        nvtx = nvtx_functions(self.device)
        report: dict[str, Any] = {"precision": precision}
        for impl in impls:
            report[impl] = self.profile_one(impl, precision, batches, nvtx)
            self.print_profile(impl, report[impl])
            free_device_caches(self.device)
        self.result["profile"] = report

    def host_profile(self, batches: list[Any]) -> None:
        """cProfile of BluTrain's host side over a few steps (after warm-up): where the Python time of a
        step goes, for the precisions where the host, not the GPU, sets the pace."""
        import cProfile
        import io
        import pstats

        a = self.args
        precision = a.profile_precision or a.precision[0]
        self.stamp(f"host profile: {precision}, BluTrain, {a.host_profile} steps under cProfile")
        set_precision(precision, self.device, self.have_torch)
        runner = build_runner("blutrain", self.cfg, self.device, precision, self.hp)
        staged = [runner.stage(x, y) for x, y in batches]
        for i in range(3):
            runner.step(staged[i % len(staged)])
        sync_device(self.device)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for i in range(a.host_profile):
            runner.step(staged[i % len(staged)])
        prof.disable()
        sync_device(self.device)
        per_step = 1e3 * (time.perf_counter() - t0) / a.host_profile
        path = self.out / f"host_profile_blutrain_{precision}.prof"
        prof.dump_stats(str(path))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
        (self.out / f"host_profile_blutrain_{precision}.txt").write_text(text.getvalue())
        print(f"   {per_step:.1f} ms per step under cProfile (its own overhead included); top functions by own time:")
        body = text.getvalue().split("Ordered by: internal time")[-1].splitlines()
        print("\n".join(line[:150] for line in body[:36]))
        self.result["host_profile"] = {"precision": precision, "steps": a.host_profile, "ms_per_step": per_step,
                                       "stats": path.name}
        del runner, staged
        free_device_caches(self.device)

    def profile_one(self, impl: str, precision: str, batches: list[Any],
                    nvtx: tuple[Callable[[str], None], Callable[[], None]]) -> dict[str, Any]:
        runner = build_runner(impl, self.cfg, self.device, precision, self.hp)
        staged = [runner.stage(x, y) for x, y in batches]
        for i in range(max(self.args.warmup, 2)):
            runner.loss_value(runner.step(staged[i % len(staged)]))
        # phases first, with no per-module hooks yet: medians of 5 steps
        rec = PhaseRecorder(runner.clock, nvtx)
        totals = []
        for i in range(5):
            start = runner.clock.mark()
            t0 = time.perf_counter()
            loss = runner.step(staged[i % len(staged)], rec)
            host = (time.perf_counter() - t0) * 1e3
            totals.append((runner.clock.ms(start, runner.clock.mark()), host))
            runner.loss_value(loss)
        entry: dict[str, Any] = {"phases": rec.summary(), "step_ms": statistics.median(t for t, _ in totals),
                                 "host_ms": statistics.median(h for _, h in totals)}
        entry.update(self.kernel_profile(runner, impl, precision, staged[0], nvtx))
        if isinstance(runner, BluTrainCompiledRunner):
            runner.close()
        return entry

    def kernel_profile(self, runner: Runner, impl: str, precision: str, batch: Any,
                       nvtx: tuple[Callable[[str], None], Callable[[], None]]) -> dict[str, Any]:
        """One step under torch.profiler with NVTX/annotation ranges per phase and per module; the kernels
        it saw, grouped by name. CUPTI reports every kernel of the process, CuPy's included."""
        if not self.have_torch:
            return {"kernels_note": "torch.profiler needs PyTorch"}
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        push, pop = nvtx
        handles = []
        for name, mod in ([] if impl == "torch-compile" else runner.modules()):  # hooks would make dynamo recompile
            # blocks, embeddings, ln_f, lm_head; not the modules inside a block: a hook on attn or mlp makes
            # BluTrain's block add the residual after the branch instead of in its projection's GEMM, and one
            # on c_fc or the GELU leaves the fused bias+GELU path, changing what is profiled
            if not name or name.count(".") > 2:
                continue
            handles.append(mod.register_forward_pre_hook(lambda m, args, n=name: push(n)))
            handles.append(mod.register_forward_hook(lambda m, args, out: pop()))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        try:
            with profile(activities=activities) as prof:
                rec = PhaseRecorder(runner.clock, nvtx, annotate=record_function)
                runner.loss_value(runner.step(batch, rec))
                if self.device == "cuda":
                    torch.cuda.synchronize()
        finally:
            for h in handles:
                h.remove()
        raw = self.out / f"profile_{impl}_{precision}.trace.json"
        prof.export_chrome_trace(str(raw))
        table = (kernel_table(raw) if self.device == "cuda" else
                 {"kernels_note": "per-kernel table: GPU only (on the CPU the profiler cannot see NumPy's work)"})
        with raw.open("rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        table["trace"] = raw.name + ".gz"
        return table

    def print_profile(self, impl: str, e: dict[str, Any]) -> None:
        print(f"\n   {impl}: step {e['step_ms']:.2f} ms on the device clock, host {e['host_ms']:.2f} ms until the "
              "step returned", flush=True)
        for name, ph in e["phases"].items():
            print(f"     {name:<10} device {ph['gpu_ms']:9.2f} ms   host {ph['host_ms']:9.2f} ms")
        if "kernels" not in e:
            print(f"     {e.get('kernels_note', '')}")
            return
        print(f"     {e['kernel_count']} kernels/copies in the profiled step, busy {e['busy_ms']:.2f} ms of a "
              f"{e['span_ms']:.2f} ms span ({e['busy_ms'] / max(e['span_ms'], 1e-9):.0%}); trace {e['trace']}")
        top = 25 if impl == "blutrain" else 12
        print(f"     {'kernel':<72} {'calls':>6} {'total ms':>9} {'share':>6}")
        for k in e["kernels"][:top]:
            print(f"     {k['name'][:72]:<72} {k['calls']:>6} {k['total_ms']:>9.3f} {k['share']:>6.1%}")


def kernel_table(trace: Path) -> dict[str, Any]:
    """Device activity of a Chrome trace grouped by name: calls, total ms, share of the busy time."""
    activity = read_chrome_trace(trace, ("kernel", "gpu_memcpy", "gpu_memset"))
    if not activity:
        return {"kernels_note": "the profiler saw no device kernels: run under nsys to use the NVTX ranges"}
    agg: dict[str, list[float]] = {}
    for k in activity:
        a = agg.setdefault(k.name, [0, 0.0])
        a[0] += 1
        a[1] += (k.end - k.start) / 1e6
    busy = sum(v[1] for v in agg.values())
    rows = sorted(({"name": k, "calls": int(v[0]), "total_ms": v[1], "share": v[1] / busy if busy else 0.0}
                   for k, v in agg.items()), key=lambda r: -r["total_ms"])
    span = max(k.end for k in activity) - min(k.start for k in activity)
    return {"kernels": rows, "kernel_count": len(activity), "busy_ms": busy, "span_ms": span / 1e6}
