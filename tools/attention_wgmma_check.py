"""Check and time the experimental Hopper flash-attention forward (attention_wgmma.cu, wgmma, bf16, D = 64).

For the GPU machine (an H100 or H200; CuPy, NumPy, ml_dtypes, optionally PyTorch). Builds attention_wgmma.cu for
sm_90a through the package (blutrain.kernels.cuda.hopper_module, as it runs the kernels), then for
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

import math
import sys
import time
import traceback
from typing import Any

import numpy as np
from attention_check_common import (
    POISON_BF16,
    D,
    bf16_bits,
    bf16_dtype,
    build,
    describe_kernel,
    device_summary,
    fail,
    finish,
    launch,
    layout_args,
    parse_variants,
    print_table,
    qkv_views,
    rel,
    sync_check,
    time_events,
    time_torch_events,
    to_f64,
    write_json,
)

# name: (warpgroups, keys per tile, K/V stages) as attention_wgmma.cu instantiates them (pipelined: 3 stages)
VARIANTS: dict[str, tuple[int, int, int]] = {
    "wg2n64": (2, 64, 2), "wg2n128": (2, 128, 2), "wg3n64": (3, 64, 2), "wg3n128": (3, 128, 2),
    "wg2n64p": (2, 64, 3), "wg2n128p": (2, 128, 3), "wg3n64p": (3, 64, 3), "wg3n128p": (3, 128, 3),
}
CHECK_SHAPES = [(16, 12, 1024), (4, 12, 1024), (1, 16, 2048), (2, 3, 200), (1, 1, 64)]
TIME_SHAPES = [(16, 12, 1024), (1, 16, 2048)]
OUT_TOL, LSE_TOL, EXISTING_TOL = 1e-2, 1e-3, 1e-2

# ---------------------------------------------------------------------------------------------- data

def make_inputs(B: int, H: int, T: int, packed: bool, rng: Any) -> tuple[Any, Any, Any]:
    """q, k, v as (B, H, T, D) uint16 views: of one packed [B, T, 3, H, D] buffer, or contiguous."""
    if packed:
        return qkv_views(bf16_bits((B, T, 3, H, D), rng))
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


# ---------------------------------------------------------------------------------------------- kernels

FAMILY = "attention_wgmma"


class Ours:
    @staticmethod
    def smem(name: str) -> int:
        wg, bn, stages = VARIANTS[name]
        return 64 * wg * 128 + stages * 2 * bn * 128 + 1024

    def __call__(self, name: str, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool, scale: float) -> None:
        B, H, T, _ = q.shape
        S = k.shape[2]
        wg = VARIANTS[name][0]
        bm = 64 * wg
        args = (q, k, v, out, lse, np.int32(T), np.int32(S), np.float32(scale), np.int32(int(causal)), np.int32(H),
                np.int32(1), *layout_args(q, k, v, out))  # group 1: one key/value head per query head
        launch(FAMILY, f"attn_wgmma_fwd_d64_{name}", ((T + bm - 1) // bm, B * H), (128 * wg,), args, self.smem(name))


def existing_forward(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    """The mma.sync kernel (attention_bf16.cu) through the package, on bf16 views of the uint16 inputs."""
    from blutrain.kernels import cuda as kc

    bf = bf16_dtype()
    res = kc.sdpa(q.view(bf), k.view(bf), v.view(bf), None, causal, scale)
    if res is None:
        raise RuntimeError("blutrain.kernels.cuda.sdpa declined the inputs")
    out, lse = res
    return out.view(np.uint16), lse


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

def time_torch(B: int, H: int, T: int, causal: bool, n_sets: int) -> float:
    import torch  # type: ignore[import-not-found, unused-ignore]
    import torch.nn.functional as F  # type: ignore[import-not-found, unused-ignore]

    sets = []
    for _ in range(n_sets):
        buf = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
        sets.append(tuple(buf[:, :, i].transpose(1, 2) for i in range(3)))
    return time_torch_events(lambda i: F.scaled_dot_product_attention(*sets[i], is_causal=causal), n_sets)


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
    args = parse_variants(__doc__, VARIANTS, "check contiguous inputs only at the two small shapes")
    if args is None:
        return 2
    names: list[str] = args.names

    import cupy as cp

    summary = device_summary()
    t0 = time.perf_counter()
    try:
        built = build(FAMILY)
    except Exception as e:
        fail(f"compile/load: {e!r}")
        traceback.print_exc()
        write_json(summary, "attention_wgmma.json")
        return 1
    print(f"built in {time.perf_counter() - t0:.1f} s: {built}", flush=True)
    summary["build"] = built
    ours = Ours()
    for n in names:
        try:
            print(f"  {n}: {describe_kernel(FAMILY, f'attn_wgmma_fwd_d64_{n}', ours.smem(n))}", flush=True)
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
    write_json(summary, "attention_wgmma.json")

    errs = {(tuple(c["shape"]), c["causal"], c["variant"]): c.get("rel_err", float("nan"))
            for c in summary["checks"] if c["packed"] or args.quick}
    print_table("\nattention forward, bf16, D = 64 (us: median device time; TFLOP/s of ours, 4 BHT^2D, half if causal)",
                rows, errs, 9)
    n_ok = sum(1 for c in summary["checks"] if "error" not in c and c.get("rel_err", 1) < OUT_TOL
               and c.get("lse_rel_err", 1) < LSE_TOL and not c.get("unwritten", 1))
    return finish(n_ok, len(summary["checks"]))


if __name__ == "__main__":
    sys.exit(main())
