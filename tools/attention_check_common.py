"""What tools/attention_wgmma_check.py and attention_wgmma_bwd_check.py share: the Hopper build through the
package, bf16 bit helpers, strided (batch, head, row) layouts, relative errors, CUDA-event timing, the failure
list, the result table and the JSON file. For the GPU machine (CuPy, NumPy; PyTorch where timed against).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
D = 64
POISON_BF16 = 0xFFFF  # a NaN the kernels never write (cvt.rn.bf16x2 gives 0x7FFF / 0xFFFF only from NaN inputs)

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"FAIL: {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- build

def build(family: str) -> str:
    """Build `family` for sm_90a through blutrain.kernels.cuda.hopper_module (NVRTC, CuPy's kernel cache), as
    the package runs it; a description of what was built."""
    from cupy_backends.cuda.libs import nvrtc

    from blutrain.kernels import cuda as kc

    if kc.hopper_module(family) is None:
        raise RuntimeError(f"blutrain.kernels.cuda.hopper_module({family!r}) is None: not a compute capability 9.0 "
                           "device, or NVRTC cannot build sm_90a")
    return f"blutrain.kernels.cuda.hopper_module, NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, sm_90a"


def launch(family: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
           smem: int) -> None:
    """One launch through the package, which raises the kernel's dynamic shared-memory limit first (driver)."""
    from blutrain.kernels.cuda import _core

    _core._launch(family, name, grid, block, args, smem)


def describe_kernel(family: str, name: str, smem: int) -> str:
    """Registers, local memory and the thread limit of one kernel (a Module's Function: the driver's attributes)."""
    from cupy_backends.cuda.api import driver

    from blutrain.kernels import cuda as kc

    f = kc.function(family, name)
    regs, local, threads = (driver.funcGetAttribute(a, f.ptr) for a in (4, 3, 0))  # CU_FUNC_ATTRIBUTE_*
    return f"{regs} registers, {local} bytes local, smem {smem} B, max threads {threads}"


# ---------------------------------------------------------------------------------------------- data

def bf16_bits(shape: tuple[int, ...], rng: Any) -> Any:
    """Random N(0, 1) values as bf16 bit patterns (uint16), round to nearest even, on the device."""
    import cupy as cp

    x = rng.standard_normal(shape, dtype=cp.float32)
    u = x.view(cp.uint32)
    u = u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))
    return (u >> 16).astype(cp.uint16)


def to_f64(bits: Any) -> Any:
    import cupy as cp

    return (bits.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)


def bf16_dtype() -> Any:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def layout(a: Any) -> tuple[int, int, int]:
    """(batch, head, row) strides in elements of a (B, H, T, D) view; a dim of size 1 counts as stride 0."""
    B, H, _, _ = a.shape
    sb, sh, sr, sd = (s // a.itemsize for s in a.strides)
    assert sd == 1 and a.data.ptr % 16 == 0 and all(s % 8 == 0 for s in (sb, sh, sr)), "rows must be 16-byte aligned"
    return (sb if B > 1 else 0, sh if H > 1 else 0, sr)


def layout_args(*views: Any) -> tuple[Any, ...]:
    """The kernels' LAYOUT_PARAMS arguments of each view: its (batch, head, row) strides as int64."""
    return tuple(np.int64(s) for t in views for s in layout(t))


def qkv_views(buf: Any) -> tuple[Any, Any, Any]:
    """The three (B, H, T, D) views of a packed [B, T, 3, H, D] buffer."""
    q, k, v = (buf[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    return q, k, v


def rel(a: Any, b: Any) -> float:
    import cupy as cp

    d = float(cp.linalg.norm((a - b).ravel()))
    n = float(cp.linalg.norm(b.ravel()))
    return d / n if n > 0 else d


def sync_check(what: str) -> bool:
    import cupy as cp

    try:
        cp.cuda.runtime.deviceSynchronize()
        return True
    except Exception as e:
        fail(f"{what}: CUDA error {e!r}")
        return False


# ---------------------------------------------------------------------------------------------- timing

def time_events(run: Any, n_sets: int, samples: int = 60, reps: int = 5, warmup: int = 10) -> float:
    """Median device time of one run(i) (launches on CuPy's stream), in microseconds: CUDA events around `reps`
    runs per sample, input set i % n_sets for run i."""
    import cupy as cp

    for i in range(warmup):
        run(i % n_sets)
    cp.cuda.runtime.deviceSynchronize()
    evs = []
    i = 0
    for _ in range(samples):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            run(i % n_sets)
            i += 1
        b.record()
        evs.append((a, b))
    cp.cuda.runtime.deviceSynchronize()
    return float(np.median([cp.cuda.get_elapsed_time(a, b) * 1e3 / reps for a, b in evs]))


def time_torch_events(run: Callable[[int], Any], n_sets: int) -> float:
    """time_events for PyTorch work (its own events and stream): warm-up 10, median of 60 samples of 5 runs."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    for i in range(10):
        run(i % n_sets)
    torch.cuda.synchronize()
    evs = []
    i = 0
    for _ in range(60):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            run(i % n_sets)
            i += 1
        b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e3 / 5 for a, b in evs]))


# ---------------------------------------------------------------------------------------------- main

def parse_variants(doc: str | None, variants: dict[str, Any], quick_help: str) -> argparse.Namespace | None:
    """--variants (validated against `variants`; None after printing the unknown one) and --quick."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(variants), help="comma-separated kernel variants")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    args = ap.parse_args()
    args.names = [n for n in args.variants.split(",") if n]
    for n in args.names:
        if n not in variants:
            print(f"--variants: unknown variant {n!r}; known: {', '.join(variants)}")
            return None
    return args


def device_summary() -> dict[str, Any]:
    """Prints the device line; the summary that checks and timings are added to."""
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"device: {device}, compute capability {dev.compute_capability}, CuPy {cp.__version__}", flush=True)
    return {"device": device, "checks": [], "timings": []}


def print_table(title: str, rows: list[dict[str, Any]], errs: dict[tuple[Any, ...], float], variant_width: int) -> None:
    """The timing rows, one a (shape, causal, variant), with the variant's error at that shape from `errs`."""
    w = variant_width
    print(title)
    print(f"{'shape (B,H,T)':<16} {'causal':<6} {'variant':<{w}} {'rel.err':>8} {'ours us':>8} {'exist us':>8} "
          f"{'torch us':>8} {'TFLOP/s':>7}")
    for r in rows:
        err = errs.get((tuple(r["shape"]), r["causal"], r["variant"]), float("nan"))
        print(f"{tuple(r['shape'])!s:<16} {r['causal']!s:<6} {r['variant']:<{w}} {err:>8.1e} "
              f"{r.get('us', float('nan')):>8.1f} {r['existing_us']:>8.1f} {r['torch_us']:>8.1f} "
              f"{r.get('tflops', float('nan')):>7.1f}")


def finish(n_ok: int, n_checks: int) -> int:
    """Prints the count of passed checks and the first failures; the exit code."""
    print(f"checks: {n_ok} of {n_checks} passed; {len(failures)} failure(s)")
    for f in failures[:40]:
        print("  " + f)
    return 1 if failures else 0


def write_json(summary: dict[str, Any], filename: str) -> None:
    """summary (with the failures) as $OUT/<filename> when OUT is set, else tools/results/<filename>."""
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "tools" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary["failures"] = failures
    path = out_dir / filename
    path.write_text(json.dumps(summary, indent=1, default=float))
    print(f"wrote {path}", flush=True)
