"""tools/bench/gpt2.py's measuring instruments: step clocks and phases (CUDA events or the host clock), NVTX
ranges, memory meters for each framework and allocator, the stage deadline, FLOPs per token and the GEMM ceilings."""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

GIB = 1024**3

PhaseFn = Callable[[str], contextlib.AbstractContextManager[Any]]


def no_phase(name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class StageTimeoutError(Exception):
    """An implementation ran past --stage-timeout: its row carries this error, and the bench goes on."""


@contextlib.contextmanager
def stage_deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`StageTimeoutError` in the block once it has run ``seconds`` (0: no limit). SIGALRM interrupts
    Python code (a trace, a compile's passes, the step loop) between bytecodes, so a native call in flight
    finishes first; the main thread only, where signals are delivered."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise StageTimeoutError(f"{what} ran past --stage-timeout {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- timing ------------------------------------------------------------------------------------------------
class Clock:
    """Times one framework's device work: CUDA events on its current stream, or the host clock on the CPU."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "torch", "cupy" or "host"
        if kind == "cupy":
            import cupy

            self._cp = cupy
        elif kind == "torch":
            import torch

            self._torch = torch

    def mark(self) -> Any:
        if self.kind == "host":
            return time.perf_counter()
        ev = self._cp.cuda.Event() if self.kind == "cupy" else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``; waits for ``end``."""
        if self.kind == "host":
            return float((end - start) * 1e3)
        end.synchronize()
        if self.kind == "cupy":
            return float(self._cp.cuda.get_elapsed_time(start, end))
        return float(start.elapsed_time(end))


class PhaseRecorder:
    """Marks the phases of a step: an NVTX range (Nsight), a profiler annotation when asked, and a clock
    mark plus host time at each boundary, so one step splits into forward / backward / optimizer."""

    def __init__(self, clock: Clock, nvtx: tuple[Callable[[str], None], Callable[[], None]],
                 annotate: Callable[[str], Any] | None = None) -> None:
        self.clock = clock
        self.push, self.pop = nvtx
        self.annotate = annotate
        self.records: list[tuple[str, float, float, Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        ev0 = self.clock.mark()
        t0 = time.perf_counter()
        self.push(name)
        with self.annotate(name) if self.annotate else contextlib.nullcontext():
            yield
        self.pop()
        t1 = time.perf_counter()
        self.records.append((name, t0, t1, ev0, self.clock.mark()))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: median GPU ms (between its boundary events) and median host ms."""
        out: dict[str, dict[str, list[float]]] = {}
        for name, t0, t1, ev0, ev1 in self.records:
            d = out.setdefault(name, {"gpu_ms": [], "host_ms": []})
            d["gpu_ms"].append(self.clock.ms(ev0, ev1))
            d["host_ms"].append((t1 - t0) * 1e3)
        return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in out.items()}


def nvtx_functions(device: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """NVTX push/pop through CuPy (ranges show in Nsight Systems); no-ops on the CPU or without NVTX."""
    if device == "cuda":
        try:
            from cupy.cuda import nvtx

            return nvtx.RangePush, nvtx.RangePop
        except Exception:
            pass
    return (lambda name: None), (lambda: None)


# -- memory ------------------------------------------------------------------------------------------------
class Meter:
    """Peak memory of one configuration: ``baseline()`` before it is built, ``begin()``/``end()`` around a
    steady step. Returns (peak allocated, peak reserved) above the baseline, in bytes."""

    source = "n/a"

    def baseline(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def end(self) -> tuple[int | None, int | None]:
        return None, None


class CudaApiMeter(Meter):
    """Peaks through a ``torch.cuda``-style module: PyTorch's own, or ``blutrain.cuda`` over blutrain-alloc
    (the cuda backend installs it), which answers the same calls."""

    def __init__(self, cuda: Any, source: str) -> None:
        self.cuda = cuda
        self.source = source
        self.base = self.base_reserved = 0

    def baseline(self) -> None:
        gc.collect()
        self.cuda.synchronize()
        self.cuda.empty_cache()  # cached blocks of earlier configurations are not this one's
        self.base, self.base_reserved = self.cuda.memory_allocated(), self.cuda.memory_reserved()

    def begin(self) -> None:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()

    def end(self) -> tuple[int | None, int | None]:
        self.cuda.synchronize()
        return (self.cuda.max_memory_allocated() - self.base,
                self.cuda.max_memory_reserved() - self.base_reserved)


def torch_meter() -> Meter:
    import torch

    return CudaApiMeter(torch.cuda, "torch.cuda max_memory_allocated / max_memory_reserved")


class CupyPoolMeter(Meter):
    """CuPy's default memory pool keeps no peak, so a ``cupy.cuda.MemoryHook`` follows it exactly during the
    measured step: live bytes change by the chunk size at every malloc and free (the pool's own rounding),
    and the pool's total bytes (cudaMalloc'd, live plus cached) can only grow at a malloc. The hook costs
    host time, so it is on only for the measured step, never for timed ones."""

    source = "CuPy memory pool, exact via cupy.cuda.MemoryHook (live chunk bytes; pool total bytes)"

    def __init__(self) -> None:
        import cupy
        from cupy.cuda import memory_hook

        self.pool = cupy.get_default_memory_pool()
        pool = self.pool

        class PoolPeakHook(memory_hook.MemoryHook):  # type: ignore[misc]
            name = "BenchPoolPeak"

            def __init__(self) -> None:
                self.live = self.peak = int(pool.used_bytes())
                self.total_peak = int(pool.total_bytes())

            def malloc_postprocess(self, **kw: Any) -> None:
                self.live += int(kw["mem_size"])
                self.peak = max(self.peak, self.live)
                self.total_peak = max(self.total_peak, int(pool.total_bytes()))

            def free_postprocess(self, **kw: Any) -> None:
                self.live -= int(kw["mem_size"])

        self.hook_class = PoolPeakHook
        self.hook: Any = None
        self.base = self.base_reserved = 0

    def baseline(self) -> None:
        gc.collect()
        self.pool.free_all_blocks()
        self.base, self.base_reserved = int(self.pool.used_bytes()), int(self.pool.total_bytes())

    def begin(self) -> None:
        import cupy

        cupy.cuda.Device().synchronize()
        self.hook = self.hook_class()
        self.hook.__enter__()

    def end(self) -> tuple[int | None, int | None]:
        import cupy

        cupy.cuda.Device().synchronize()
        self.hook.__exit__(None, None, None)
        return self.hook.peak - self.base, self.hook.total_peak - self.base_reserved


def blutrain_meter() -> Meter:
    """BluTrain's allocator statistics when the cuda backend allocates through blutrain-alloc, else an exact
    hook on CuPy's pool."""
    from blutrain_backend_cupy import cuda

    if hasattr(cuda, "max_memory_allocated"):
        try:
            cuda.max_memory_allocated()  # raises when CuPy's own pool is in use
            return CudaApiMeter(cuda, "blutrain-alloc caching allocator: allocated_bytes_peak / reserved_bytes_peak")
        except Exception:
            pass
    import cupy

    if cupy.cuda.get_allocator() != cupy.get_default_memory_pool().malloc:
        raise RuntimeError("BluTrain's CuPy allocator is neither blutrain-alloc nor CuPy's default pool: "
                           "no peak statistic to read")
    return CupyPoolMeter()


def free_device_caches(device: str, compiled: bool = False) -> None:
    """Give cached device memory back (both frameworks), so the next stage's peaks are its own."""
    gc.collect()
    with contextlib.suppress(ImportError):
        import torch

        if compiled:
            torch._dynamo.reset()  # compiled graphs may hold the last models' tensors
            gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if device != "cuda":
        return
    from blutrain_backend_cupy import cuda

    cuda.synchronize()
    if hasattr(cuda, "empty_cache"):
        cuda.empty_cache()
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


# -- FLOPs and ceilings ------------------------------------------------------------------------------------
def non_embedding_params(cfg: Any) -> int:
    """Parameters without the position embedding (nanoGPT's count; the tied head is the token embedding)."""
    C, L = cfg.n_embd, cfg.n_layer
    per_block = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    return cfg.vocab_size * C + L * per_block + 2 * C


def counted_non_embedding_params(net: Any) -> int:
    """Parameters outside embedding tables of the BluTrain model ``net`` (a family other than GPT-2, whose count
    has no closed form here)."""
    from blutrain.nn import Embedding

    return sum(p.numel() for m in net.modules() if not isinstance(m, Embedding) for p in m.parameters(recurse=False))


def resident_training_bytes(params: int) -> int:
    """What one implementation keeps on the device between steps: float32 weights, gradients and AdamW's two
    moments, 16 bytes a parameter (activations, caches and compiled arenas come on top)."""
    return 16 * params


def flops_per_token(cfg: Any, seq: int, non_embedding: int | None = None) -> float:
    """6·N + 12·L·H·Q·T (H·Q = n_embd); N from GPT-2's closed form unless given."""
    n = non_embedding_params(cfg) if non_embedding is None else non_embedding
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * seq


def gemm_ceilings(device: str, precisions: list[str]) -> dict[str, float]:
    """TFLOP/s of a large square torch.matmul in each mode's dtype (the machine's ceiling for GEMMs)."""
    import torch

    n = 8192 if device == "cuda" else 1024
    out: dict[str, float] = {}
    for prec in precisions:
        if device == "cpu" and prec != "fp32":  # no TF32 on CPUs; bf16 GEMM speed there varies too much by ISA
            continue
        torch.set_float32_matmul_precision("high" if prec == "tf32" else "highest")
        dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        clock = Clock("torch" if device == "cuda" else "host")
        reps = 10 if device == "cuda" else 2
        times = []
        for trial in range(6):
            start = clock.mark()
            for _ in range(reps):
                torch.matmul(a, b)
            ms = clock.ms(start, clock.mark()) / reps
            if trial:  # the first is warm-up
                times.append(ms)
        out[prec] = 2 * n**3 / (min(times) * 1e-3) / 1e12  # a ceiling: the best trial
        del a, b
    torch.set_float32_matmul_precision("highest")
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def spec_peaks(gpu_name: str) -> tuple[str | None, dict[str, float]]:
    name = gpu_name.upper()
    if "H200" in name:
        key = "H200"
    elif "H100" in name:
        key = "H100 PCIe" if "PCIE" in name else "H100 NVL" if "NVL" in name else "H100 SXM"
    else:
        return None, {}
    return key, SPEC_PEAKS[key]


SPEC_PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0},
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
}


# -- small helpers -------------------------------------------------------------------------------------
def sync_device(device: str) -> None:
    """Wait for the GPU (host-side timings that must include the queued work)."""
    if device == "cuda":
        import cupy

        cupy.cuda.Device().synchronize()


def check_finite(value: float, impl: str, step: int) -> float:
    if not math.isfinite(value):
        raise FloatingPointError(f"{impl}: non-finite loss {value} at step {step}")
    return value


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_ratio(v: float | None) -> str:
    return f"{v:.2f}×" if v is not None else "-"


def fmt_pct(v: float | None) -> str:
    return f"{v:.1%}" if v is not None else "-"


def fmt_count(v: float) -> str:
    return "" if not v else f"{v / 1e3:,.1f}k" if v >= 1e3 else f"{v:.0f}"


def fmt_gib(v: int | None) -> str:
    return f"{v / GIB:.2f}" if v is not None else "-"


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no PNG written", flush=True)
        return None
    return plt
