"""Check and time the experimental Hopper flash-attention forward (attention_wgmma.cu, wgmma, bf16, D = 64).

For the GPU machine (an H100 or H200; CuPy, NumPy, ml_dtypes, optionally PyTorch). Compiles attention_wgmma.cu
with NVRTC for sm_90a directly (CuPy's RawModule appends its own -arch=sm_90, and wgmma needs sm_90a), then for
every kernel variant, shape (B, H, T) and causal flag, on fresh random bf16 q, k, v (strided views of one packed
[B, T, 3, H, D] buffer, as GPT-2 passes them, and contiguous [B, H, T, D] tensors), with poisoned outputs:

  * out and lse against a float64 reference (‖out − ref‖ / ‖ref‖; bf16 passes under 1e-2, lse under 1e-3),
  * out against the existing mma.sync kernel (blutrain.kernels.cuda.sdpa, attention_bf16.cu),
  * that every element of out and lse was written.

Then times each variant, the existing kernel and torch.nn.functional.scaled_dot_product_attention (bf16,
is_causal) with CUDA events (warm-up, median of 60 samples of 5 launches each, 4 input sets in rotation) at
GPT-2's shape (16, 12, 1024) and at (1, 16, 2048), and prints a table last. Full results go to
$OUT/attention_wgmma.json when OUT is set, else tools/results/attention_wgmma.json. Every CUDA error or
mismatch is printed and the script goes on with the next case; the exit code is 1 if any case failed.

    python3 tools/attention_wgmma_check.py [--variants wg2n64,wg2n64p] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CU_DIR = ROOT / "packages" / "blutrain-kernels" / "src" / "blutrain" / "kernels" / "cuda"
D = 64
# name: (warpgroups, keys per tile, K/V stages) as attention_wgmma.cu instantiates them (pipelined: 3 stages; p2:
# two tiles ahead, 4; s: causal tiles heavy-first across heads, same grid)
VARIANTS: dict[str, tuple[int, int, int]] = {
    "wg2n64": (2, 64, 2), "wg2n128": (2, 128, 2), "wg3n64": (3, 64, 2), "wg3n128": (3, 128, 2),
    "wg2n64p": (2, 64, 3), "wg2n128p": (2, 128, 3), "wg3n64p": (3, 64, 3), "wg3n128p": (3, 128, 3),
    "wg2n64p2": (2, 64, 4), "wg2n64ps": (2, 64, 3), "wg2n64p2s": (2, 64, 4),
}
CHECK_SHAPES = [(16, 12, 1024), (4, 12, 1024), (1, 16, 2048), (2, 3, 200), (1, 1, 64)]
TIME_SHAPES = [(16, 12, 1024), (1, 16, 2048)]
POISON_BF16 = 0xFFFF  # a NaN the kernel never writes (cvt.rn.bf16x2 gives 0x7FFF / 0xFFFF only from NaN inputs)
OUT_TOL, LSE_TOL, EXISTING_TOL = 1e-2, 1e-3, 1e-2

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"FAIL: {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- build

def compile_module() -> tuple[Any, str]:
    """attention_wgmma.cu (common.cuh pasted in, as the package does) through NVRTC for sm_90a; the loaded
    cupy Module and a description of what was built."""
    import cupy as cp
    from cupy_backends.cuda.libs import nvrtc

    src = (CU_DIR / "attention_wgmma.cu").read_text()
    src = src.replace('#include "common.cuh"', (CU_DIR / "common.cuh").read_text())
    opts = ["-arch=sm_90a", "-std=c++17"]  # the package's _OPTIONS are ("-std=c++17",): no fast math
    inc = [Path(cp.__file__).parent / "_core" / "include"]
    with contextlib.suppress(Exception):  # optional
        inc.append(Path(cp.cuda.get_cuda_path()) / "include")
    opts += [f"-I{p}" for p in inc if p.is_dir()]
    prog = nvrtc.createProgram(src, "attention_wgmma.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception:
            print("NVRTC compile failed; options:", opts, "\n", nvrtc.getProgramLog(prog), flush=True)
            raise
        log = nvrtc.getProgramLog(prog)
        if log.strip():
            print("NVRTC log:\n" + log, flush=True)
        get_cubin = getattr(nvrtc, "getCUBIN", None)
        if get_cubin is not None:
            image, kind = get_cubin(prog), "cubin"
        else:
            image, kind = nvrtc.getPTX(prog).encode(), "ptx"
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(image, str):
        image = image.encode("latin-1")
    mod = cp.cuda.function.Module()
    mod.load(image)
    return mod, f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, {kind}, options {' '.join(opts)}"


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


def layout(a: Any) -> tuple[int, int, int]:
    """(batch, head, row) strides in elements of a (B, H, T, D) view; a dim of size 1 counts as stride 0."""
    B, H, _, _ = a.shape
    sb, sh, sr, sd = (s // a.itemsize for s in a.strides)
    assert sd == 1 and a.data.ptr % 16 == 0 and all(s % 8 == 0 for s in (sb, sh, sr)), "rows must be 16-byte aligned"
    return (sb if B > 1 else 0, sh if H > 1 else 0, sr)


def make_inputs(B: int, H: int, T: int, packed: bool, rng: Any) -> tuple[Any, Any, Any]:
    """q, k, v as (B, H, T, D) uint16 views: of one packed [B, T, 3, H, D] buffer, or contiguous."""
    if packed:
        buf = bf16_bits((B, T, 3, H, D), rng)
        return tuple(buf[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # type: ignore[return-value, unused-ignore]
    return bf16_bits((B, H, T, D), rng), bf16_bits((B, H, T, D), rng), bf16_bits((B, H, T, D), rng)


def reference(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    """float64 attention on the device, (B, H) flattened and taken in chunks: (out [BH, T, D], lse [BH, T])."""
    import cupy as cp

    B, H, T, _ = q.shape
    q2, k2, v2 = (x.reshape(B * H, T, D) if x.flags.c_contiguous else cp.ascontiguousarray(x).reshape(B * H, T, D)
                  for x in (q, k, v))
    out = cp.empty((B * H, T, D), cp.float64)
    lse = cp.empty((B * H, T), cp.float64)
    chunk = max(1, (1 << 27) // (T * T))
    mask = cp.triu(cp.ones((T, T), dtype=bool), 1) if causal else None
    for i in range(0, B * H, chunk):
        qs, ks, vs = (to_f64(x[i:i + chunk]) for x in (q2, k2, v2))
        s = cp.matmul(qs, ks.transpose(0, 2, 1)) * scale
        if mask is not None:
            s = cp.where(mask, -cp.inf, s)
        m = s.max(axis=-1, keepdims=True)
        p = cp.exp(s - m)
        l_ = p.sum(axis=-1, keepdims=True)
        out[i:i + chunk] = cp.matmul(p, vs) / l_
        lse[i:i + chunk] = (m + cp.log(l_))[..., 0]
    return out, lse


def rel(a: Any, b: Any) -> float:
    import cupy as cp

    d = float(cp.linalg.norm((a - b).ravel()))
    n = float(cp.linalg.norm(b.ravel()))
    return d / n if n > 0 else d


# ---------------------------------------------------------------------------------------------- kernels

class Ours:
    def __init__(self, mod: Any) -> None:
        self.mod = mod
        self.fns: dict[str, Any] = {}

    def smem(self, name: str) -> int:
        wg, bn, stages = VARIANTS[name]
        return 64 * wg * 128 + stages * 2 * bn * 128 + 1024

    def fn(self, name: str) -> Any:
        f = self.fns.get(name)
        if f is None:
            f = self.mod.get_function(f"attn_wgmma_fwd_d64_{name}")
            smem = self.smem(name)
            if smem > 48 * 1024:  # a Module's Function has no attribute setter: the driver call (cudaFuncSetAttribute)
                from cupy_backends.cuda.api import driver
                driver.funcSetAttribute(f.ptr, 8, smem)  # 8: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.fns[name] = f
        return f

    def __call__(self, name: str, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool, scale: float) -> None:
        B, H, T, _ = q.shape
        S = k.shape[2]
        wg = VARIANTS[name][0]
        bm = 64 * wg
        args = (q, k, v, out, lse, np.int32(T), np.int32(S), np.float32(scale), np.int32(int(causal)), np.int32(H),
                *(np.int64(s) for t in (q, k, v, out) for s in layout(t)))
        self.fn(name)(((T + bm - 1) // bm, B * H), (128 * wg,), args, shared_mem=self.smem(name))


def existing_forward(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    """The mma.sync kernel (attention_bf16.cu) through the package, on bf16 views of the uint16 inputs."""
    import ml_dtypes

    from blutrain.kernels import cuda as kc

    bf = np.dtype(ml_dtypes.bfloat16)
    res = kc.sdpa(q.view(bf), k.view(bf), v.view(bf), None, causal, scale)
    if res is None:
        raise RuntimeError("blutrain.kernels.cuda.sdpa declined the inputs")
    out, lse = res
    return out.view(np.uint16), lse


def sync_check(what: str) -> bool:
    import cupy as cp

    try:
        cp.cuda.runtime.deviceSynchronize()
        return True
    except Exception as e:
        fail(f"{what}: CUDA error {e!r}")
        return False


# ---------------------------------------------------------------------------------------------- checks

def check_case(ours: Ours, name: str, B: int, H: int, T: int, causal: bool, packed: bool, rng: Any,
               results: list[dict[str, Any]]) -> None:
    import cupy as cp

    tag = f"{name} B={B} H={H} T={T} causal={causal} {'packed' if packed else 'contiguous'}"
    rec: dict[str, Any] = {"variant": name, "shape": [B, H, T], "causal": causal, "packed": packed}
    results.append(rec)
    try:
        scale = 1.0 / math.sqrt(D)
        q, k, v = make_inputs(B, H, T, packed, rng)
        if packed:  # written as the [B, T, H, D] buffer GPT-2 merges heads from
            out_buf = cp.full((B, T, H, D), POISON_BF16, dtype=cp.uint16)
            out = out_buf.transpose(0, 2, 1, 3)
        else:
            out_buf = cp.full((B, H, T, D), POISON_BF16, dtype=cp.uint16)
            out = out_buf
        lse = cp.full((B * H, T), cp.nan, dtype=cp.float32)
        ours(name, q, k, v, out, lse, causal, scale)
        if not sync_check(tag):
            rec["error"] = "cuda"
            return
        unwritten = int((out_buf == POISON_BF16).sum()) + int(cp.isnan(lse).sum())
        ref_out, ref_lse = reference(q, k, v, causal, scale)
        got = to_f64(cp.ascontiguousarray(out)).reshape(B * H, T, D)
        err = rel(got, ref_out)
        lse_err = rel(lse.astype(cp.float64), ref_lse)
        rec.update(rel_err=err, lse_rel_err=lse_err, unwritten=unwritten)
        ok = True
        if unwritten:
            fail(f"{tag}: {unwritten} output elements not written (or NaN)")
            ok = False
        if not err < OUT_TOL:
            fail(f"{tag}: out rel err {err:.3e} (tolerance {OUT_TOL})")
            ok = False
        if not lse_err < LSE_TOL:
            fail(f"{tag}: lse rel err {lse_err:.3e} (tolerance {LSE_TOL})")
            ok = False
        try:
            ex_out, ex_lse = existing_forward(q, k, v, causal, scale)
            ex = to_f64(ex_out).reshape(B * H, T, D)
            vs_existing = rel(got, ex)
            rec.update(vs_existing=vs_existing, existing_rel_err=rel(ex, ref_out),
                       lse_vs_existing=rel(lse.astype(cp.float64), ex_lse.reshape(B * H, T).astype(cp.float64)))
            if not vs_existing < EXISTING_TOL:
                fail(f"{tag}: differs from the existing kernel by {vs_existing:.3e}")
                ok = False
        except Exception as e:
            rec["existing_error"] = repr(e)
            print(f"  (existing kernel not compared: {e!r})", flush=True)
        own = rec.get("existing_rel_err", float("nan"))
        print(f"{'ok  ' if ok else 'BAD '} {tag}: rel err {err:.2e}, lse {lse_err:.2e}, vs existing "
              f"{rec.get('vs_existing', float('nan')):.2e} (existing's own {own:.2e})", flush=True)
    except Exception as e:
        rec["error"] = repr(e)
        fail(f"{tag}: {e!r}")
        traceback.print_exc()
        sync_check(tag + " (after exception)")


# ---------------------------------------------------------------------------------------------- timing

def time_events(launch: Any, n_sets: int, samples: int = 60, reps: int = 5, warmup: int = 10) -> float:
    """Median device time of one launch, in microseconds: CUDA events around `reps` launches per sample,
    input set i % n_sets for launch i."""
    import cupy as cp

    for i in range(warmup):
        launch(i % n_sets)
    cp.cuda.runtime.deviceSynchronize()
    evs = []
    i = 0
    for _ in range(samples):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            launch(i % n_sets)
            i += 1
        b.record()
        evs.append((a, b))
    cp.cuda.runtime.deviceSynchronize()
    return float(np.median([cp.cuda.get_elapsed_time(a, b) * 1e3 / reps for a, b in evs]))


def time_torch(B: int, H: int, T: int, causal: bool, n_sets: int) -> float:
    import torch  # type: ignore[import-not-found, unused-ignore]
    import torch.nn.functional as F  # type: ignore[import-not-found, unused-ignore]

    sets = []
    for _ in range(n_sets):
        buf = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
        sets.append(tuple(buf[:, :, i].transpose(1, 2) for i in range(3)))
    for i in range(10):
        F.scaled_dot_product_attention(*sets[i % n_sets], is_causal=causal)
    torch.cuda.synchronize()
    evs = []
    i = 0
    for _ in range(60):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            F.scaled_dot_product_attention(*sets[i % n_sets], is_causal=causal)
            i += 1
        b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e3 / 5 for a, b in evs]))


def time_shape(ours: Ours, names: list[str], B: int, H: int, T: int, causal: bool, rng: Any,
               rows: list[dict[str, Any]]) -> None:
    import cupy as cp

    n_sets = 4
    scale = 1.0 / math.sqrt(D)
    flops = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    sets = [make_inputs(B, H, T, True, rng) for _ in range(n_sets)]
    out_buf = cp.empty((B, T, H, D), dtype=cp.uint16)
    out = out_buf.transpose(0, 2, 1, 3)
    lse = cp.empty((B * H, T), dtype=cp.float32)
    base: dict[str, Any] = {"shape": [B, H, T], "causal": causal}
    existing_us = torch_us = float("nan")
    try:
        existing_us = time_events(lambda i: existing_forward(*sets[i], causal, scale), n_sets)
    except Exception as e:
        print(f"existing kernel not timed at {B, H, T} causal={causal}: {e!r}", flush=True)
        sync_check("existing timing")
    try:
        torch_us = time_torch(B, H, T, causal, n_sets)
    except Exception as e:
        print(f"torch not timed at {B, H, T} causal={causal}: {e!r}", flush=True)
    for name in names:
        row = dict(base, variant=name, existing_us=existing_us, torch_us=torch_us)
        try:
            us = time_events(lambda i, name=name: ours(name, *sets[i], out, lse, causal, scale), n_sets)
            if not sync_check(f"timing {name}"):
                row["error"] = "cuda"
            row.update(us=us, tflops=flops / us * 1e-6)
        except Exception as e:
            row["error"] = repr(e)
            fail(f"timing {name} {B, H, T} causal={causal}: {e!r}")
        rows.append(row)
    sets.clear()
    cp.get_default_memory_pool().free_all_blocks()


# ---------------------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated kernel variants")
    ap.add_argument("--quick", action="store_true", help="check contiguous inputs only at the two small shapes")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    for n in names:
        if n not in VARIANTS:
            print(f"--variants: unknown variant {n!r}; known: {', '.join(VARIANTS)}")
            return 2

    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"device: {device}, compute capability {dev.compute_capability}, CuPy {cp.__version__}", flush=True)
    summary: dict[str, Any] = {"device": device, "checks": [], "timings": []}
    t0 = time.perf_counter()
    try:
        mod, built = compile_module()
    except Exception as e:
        fail(f"compile/load: {e!r}")
        traceback.print_exc()
        write_json(summary)
        return 1
    print(f"built in {time.perf_counter() - t0:.1f} s: {built}", flush=True)
    summary["build"] = built
    ours = Ours(mod)
    for n in names:
        try:
            f = ours.fn(n)
            from cupy_backends.cuda.api import driver  # a Module's Function: attributes through the driver

            regs, local, threads = (driver.funcGetAttribute(a, f.ptr) for a in (4, 3, 0))  # CU_FUNC_ATTRIBUTE_*
            print(f"  {n}: {regs} registers, {local} bytes local, smem {ours.smem(n)} B, max threads {threads}",
                  flush=True)
        except Exception as e:
            fail(f"{n}: get_function: {e!r}")

    rng = cp.random.default_rng(1234)
    shapes = CHECK_SHAPES[3:] if args.quick else CHECK_SHAPES
    for (B, H, T) in shapes:
        for causal in (True, False):
            for packed in ((False,) if args.quick else (True, False)):
                for n in names:
                    check_case(ours, n, B, H, T, causal, packed, rng, summary["checks"])
        cp.get_default_memory_pool().free_all_blocks()

    rows: list[dict[str, Any]] = summary["timings"]
    if not args.quick:
        for (B, H, T) in TIME_SHAPES:
            for causal in (True, False):
                time_shape(ours, names, B, H, T, causal, rng, rows)
    write_json(summary)

    errs = {(tuple(c["shape"]), c["causal"], c["variant"]): c.get("rel_err", float("nan"))
            for c in summary["checks"] if c["packed"] or args.quick}
    print("\nattention forward, bf16, D = 64 (us: median device time; TFLOP/s of ours, 4 BHT^2D, half if causal)")
    print(f"{'shape (B,H,T)':<16} {'causal':<6} {'variant':<9} {'rel.err':>8} {'ours us':>8} {'exist us':>8} "
          f"{'torch us':>8} {'TFLOP/s':>7}")
    for r in rows:
        err = errs.get((tuple(r["shape"]), r["causal"], r["variant"]), float("nan"))
        print(f"{tuple(r['shape'])!s:<16} {r['causal']!s:<6} {r['variant']:<9} {err:>8.1e} "
              f"{r.get('us', float('nan')):>8.1f} {r['existing_us']:>8.1f} {r['torch_us']:>8.1f} "
              f"{r.get('tflops', float('nan')):>7.1f}")
    n_ok = sum(1 for c in summary["checks"] if "error" not in c and c.get("rel_err", 1) < OUT_TOL
               and c.get("lse_rel_err", 1) < LSE_TOL and not c.get("unwritten", 1))
    print(f"checks: {n_ok} of {len(summary['checks'])} passed; {len(failures)} failure(s)")
    for f in failures[:40]:
        print("  " + f)
    return 1 if failures else 0


def write_json(summary: dict[str, Any]) -> None:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "tools" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary["failures"] = failures
    path = out_dir / "attention_wgmma.json"
    path.write_text(json.dumps(summary, indent=1, default=float))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
