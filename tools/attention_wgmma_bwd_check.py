"""Check and time the Hopper flash-attention backward (attention_wgmma_bwd.cu, wgmma, bf16, D = 64).

For the GPU machine (an H100 or H200; CuPy, NumPy, ml_dtypes, optionally PyTorch). Builds
attention_wgmma_bwd.cu for sm_90a through the package (blutrain.kernels.cuda.hopper_module), then for
every variant (a dq kernel and a dk/dv kernel), shape (B, H, T) and causal flag, on fresh random bf16 q, k, v,
dO (strided views of packed [B, T, 3, H, D] / [B, T, H, D] buffers, as GPT-2 passes them, and contiguous
[B, H, T, D] tensors), with out and lse from the production forward (blutrain.kernels.cuda.sdpa) and poisoned
outputs:

  * dq, dk, dv against a float64 reference (‖x − ref‖ / ‖ref‖ under 1e-2 each),
  * dq, dk, dv against the existing backward (blutrain.kernels.cuda.sdpa_backward, attention_bf16.cu),
  * Delta and lse2 (written by the dq kernel for the dk/dv kernel) against float64,
  * that every element of dq, dk, dv, Delta and lse2 was written.

Then times each variant (both kernels), the existing backward and PyTorch's SDPA backward (bf16, autograd,
backward only) with CUDA events (warm-up, median of 60 samples of 5 runs each, 4 input sets in rotation) at
(16, 12, 1024) and (1, 16, 2048), and prints a table last. Results go to $OUT/attention_wgmma_bwd.json when OUT
is set, else tools/results/attention_wgmma_bwd.json. Every CUDA error or mismatch is printed and the script
goes on; the exit code is 1 if any case failed.

    python3 tools/attention_wgmma_bwd_check.py [--variants wg1,wg2] [--quick]
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

LOG2E = 1.4426950408889634
# kernel suffix: (warpgroups, cp.async stages of the streamed tiles), as attention_wgmma_bwd.cu instantiates
# attn_wgmma_bwd_dq_d64_<suffix> and attn_wgmma_bwd_dkv_d64_<suffix>
DQ_KERNELS: dict[str, tuple[int, int]] = {"wg2": (2, 2), "wg1": (1, 2)}
DKV_KERNELS: dict[str, tuple[int, int]] = {"wg2": (2, 2), "wg1": (1, 2)}
# name: (dq kernel suffix, dk/dv kernel suffix)
VARIANTS: dict[str, tuple[str, str]] = {
    "wg2": ("wg2", "wg2"), "wg1": ("wg1", "wg1"), "dq2kv1": ("wg2", "wg1"), "dq1kv2": ("wg1", "wg2"),
}
CHECK_SHAPES = [(16, 12, 1024), (1, 16, 2048), (2, 3, 200), (1, 1, 64), (1, 2, 130)]
TIME_SHAPES = [(16, 12, 1024), (1, 16, 2048)]
GRAD_TOL, ROW_TOL, EXISTING_TOL = 1e-2, 1e-3, 1e-2

# ---------------------------------------------------------------------------------------------- data

def make_inputs(B: int, H: int, T: int, packed: bool, rng: Any) -> tuple[Any, Any, Any, Any]:
    """q, k, v, dO as (B, H, T, D) uint16 views: of packed [B, T, 3, H, D] and [B, T, H, D] buffers, or
    contiguous."""
    if packed:
        q, k, v = qkv_views(bf16_bits((B, T, 3, H, D), rng))
        return q, k, v, bf16_bits((B, T, H, D), rng).transpose(0, 2, 1, 3)
    return tuple(bf16_bits((B, H, T, D), rng) for _ in range(4))


def grad_buffers(B: int, H: int, T: int, packed: bool) -> tuple[Any, list[Any]]:
    """Poisoned dq, dk, dv (views of one packed buffer when `packed`) and the buffers that hold them."""
    import cupy as cp

    if packed:
        buf = cp.full((B, T, 3, H, D), POISON_BF16, dtype=cp.uint16)
        return qkv_views(buf), [buf]
    grads = tuple(cp.full((B, H, T, D), POISON_BF16, dtype=cp.uint16) for _ in range(3))
    return grads, list(grads)


def flat(x: Any) -> Any:
    import cupy as cp

    B, H, T, _ = x.shape
    return cp.ascontiguousarray(x).reshape(B * H, T, D)


def reference(q: Any, k: Any, v: Any, do: Any, causal: bool, scale: float) -> dict[str, Any]:
    """float64 attention backward on the device, (B, H) flattened, in chunks: dq, dk, dv [BH, T, D], Delta
    (rowsum(dO * out)) and lse [BH, T]."""
    import cupy as cp

    B, H, T, _ = q.shape
    q2, k2, v2, do2 = (flat(x) for x in (q, k, v, do))
    res = {n: cp.empty((B * H, T, D), cp.float64) for n in ("dq", "dk", "dv")}
    res.update({n: cp.empty((B * H, T), cp.float64) for n in ("delta", "lse")})
    chunk = max(1, (1 << 26) // (T * T))
    mask = cp.triu(cp.ones((T, T), dtype=bool), 1) if causal else None
    for i in range(0, B * H, chunk):
        qs, ks, vs, dos = (to_f64(x[i:i + chunk]) for x in (q2, k2, v2, do2))
        s = cp.matmul(qs, ks.transpose(0, 2, 1)) * scale
        if mask is not None:
            s = cp.where(mask, -cp.inf, s)
        m = s.max(axis=-1, keepdims=True)
        p = cp.exp(s - m)
        l_ = p.sum(axis=-1, keepdims=True)
        p /= l_
        del s
        out = cp.matmul(p, vs)
        delta = (dos * out).sum(axis=-1)
        dp = cp.matmul(dos, vs.transpose(0, 2, 1))
        ds = p * (dp - delta[..., None])
        del dp
        res["dq"][i:i + chunk] = cp.matmul(ds, ks) * scale
        res["dk"][i:i + chunk] = cp.matmul(ds.transpose(0, 2, 1), qs) * scale
        res["dv"][i:i + chunk] = cp.matmul(p.transpose(0, 2, 1), dos)
        res["delta"][i:i + chunk] = delta
        res["lse"][i:i + chunk] = (m + cp.log(l_))[..., 0]
        del p, ds
    return res


# ---------------------------------------------------------------------------------------------- kernels

def production_forward(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    """out (uint16 bits) and float32 lse from blutrain.kernels.cuda.sdpa on bf16 views of the inputs."""
    from blutrain.kernels import cuda as kc

    bf = bf16_dtype()
    res = kc.sdpa(q.view(bf), k.view(bf), v.view(bf), None, causal, scale)
    if res is None:
        raise RuntimeError("blutrain.kernels.cuda.sdpa declined the inputs")
    out, lse = res
    return out.view(np.uint16), lse


def existing_backward(do: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool,
                      scale: float) -> tuple[Any, Any, Any]:
    """The mma.sync backward (attention_bf16.cu) through the package: dq, dk, dv as uint16 bits."""
    from blutrain.kernels import cuda as kc

    bf = bf16_dtype()
    res = kc.sdpa_backward(do.view(bf), q.view(bf), k.view(bf), v.view(bf), out.view(bf), lse, None, causal, scale)
    if res is None:
        raise RuntimeError("blutrain.kernels.cuda.sdpa_backward declined the inputs")
    return tuple(g.view(np.uint16) for g in res)


FAMILY = "attention_wgmma_bwd"


class Ours:
    @staticmethod
    def smem(kernel: str, suffix: str) -> int:
        """Dynamic shared memory of attn_wgmma_bwd_<kernel>_d64_<suffix> (attention_wgmma_bwd.cu's header): the
        block's own tiles (2 of 64 wg rows), `stages` pairs of streamed 64-row tiles, the per-row floats and the
        1024 bytes of alignment slack."""
        wg, stages = (DQ_KERNELS if kernel == "dq" else DKV_KERNELS)[suffix]
        own, streamed = 2 * 64 * wg * 128, 2 * stages * 64 * 128
        if kernel == "dq":
            return own + streamed + 8 * 64 * wg + 1024
        return own + streamed + 2 * stages * 64 * 4 + 1024

    def __call__(self, name: str, q: Any, k: Any, v: Any, out: Any, do: Any, lse: Any, lse2: Any, delta: Any,
                 dq: Any, dk: Any, dv: Any, causal: bool, scale: float) -> None:
        """dq kernel, then dk/dv kernel; lse float32 [B*H, L] contiguous, lse2 and delta written (same shape)."""
        B, H, L, _ = q.shape
        S = k.shape[2]
        sq, skv = VARIANTS[name]
        wq, wkv = DQ_KERNELS[sq][0], DKV_KERNELS[skv][0]
        head = (np.int32(L), np.int32(S), np.float32(scale), np.int32(int(causal)), np.int32(H),
                np.int32(1))  # group 1: one key/value head per query head
        launch(FAMILY, f"attn_wgmma_bwd_dq_d64_{sq}", ((L + 64 * wq - 1) // (64 * wq), B * H), (128 * wq,),
               (q, k, v, out, do, lse, lse2, delta, dq, *head, *layout_args(q, k, v, out, do, dq)),
               self.smem("dq", sq))
        launch(FAMILY, f"attn_wgmma_bwd_dkv_d64_{skv}", ((S + 64 * wkv - 1) // (64 * wkv), B * H), (128 * wkv,),
               (q, k, v, do, lse2, delta, dk, dv, *head, *layout_args(q, k, v, do, dk, dv)),
               self.smem("dkv", skv))


# ---------------------------------------------------------------------------------------------- checks

def check_case(ours: Ours, names: list[str], B: int, H: int, T: int, causal: bool, packed: bool, rng: Any,
               results: list[dict[str, Any]]) -> None:
    """One set of inputs, the reference and the existing backward once, every variant against them."""
    import cupy as cp

    base_tag = f"B={B} H={H} T={T} causal={causal} {'packed' if packed else 'contiguous'}"
    scale = 1.0 / math.sqrt(D)
    try:
        q, k, v, do = make_inputs(B, H, T, packed, rng)
        out, lse = production_forward(q, k, v, causal, scale)
        lse = cp.ascontiguousarray(lse, dtype=cp.float32).reshape(B * H, T)
        ref = reference(q, k, v, do, causal, scale)
        existing: tuple[Any, ...] | None = None
        try:
            existing = tuple(to_f64(flat(g)) for g in existing_backward(do, q, k, v, out, lse, causal, scale))
        except Exception as e:
            print(f"  (existing backward not compared at {base_tag}: {e!r})", flush=True)
            sync_check(base_tag + " (existing backward)")
    except Exception as e:
        fail(f"{base_tag}: setup: {e!r}")
        traceback.print_exc()
        sync_check(base_tag + " (setup)")
        return
    for name in names:
        tag = f"{name} {base_tag}"
        rec: dict[str, Any] = {"variant": name, "shape": [B, H, T], "causal": causal, "packed": packed}
        results.append(rec)
        try:
            (dq, dk, dv), bufs = grad_buffers(B, H, T, packed)
            lse2 = cp.full((B * H, T), cp.nan, dtype=cp.float32)
            delta = cp.full((B * H, T), cp.nan, dtype=cp.float32)
            ours(name, q, k, v, out, do, lse, lse2, delta, dq, dk, dv, causal, scale)
            if not sync_check(tag):
                rec["error"] = "cuda"
                continue
            unwritten = sum(int((b == POISON_BF16).sum()) for b in bufs)
            unwritten += int(cp.isnan(lse2).sum()) + int(cp.isnan(delta).sum())
            rec["unwritten"] = unwritten
            ok = True
            if unwritten:
                fail(f"{tag}: {unwritten} output elements not written (or NaN)")
                ok = False
            got = {"dq": to_f64(flat(dq)), "dk": to_f64(flat(dk)), "dv": to_f64(flat(dv))}
            for i, g in enumerate(("dq", "dk", "dv")):
                err = rel(got[g], ref[g])
                rec[f"{g}_rel_err"] = err
                if not err < GRAD_TOL:
                    fail(f"{tag}: {g} rel err {err:.3e} (tolerance {GRAD_TOL})")
                    ok = False
                if existing is not None:
                    vs = rel(got[g], existing[i])
                    rec[f"{g}_vs_existing"] = vs
                    rec[f"{g}_existing_rel_err"] = rel(existing[i], ref[g])
                    if not vs < EXISTING_TOL:
                        fail(f"{tag}: {g} differs from the existing backward by {vs:.3e}")
                        ok = False
            rec["delta_rel_err"] = rel(delta.astype(cp.float64), ref["delta"])
            rec["lse2_rel_err"] = rel(lse2.astype(cp.float64), ref["lse"] * LOG2E)
            # Delta is rowsum(dO * out) of the bf16 out the kernels read; the reference's is of the float64 out, so
            # the two differ by bf16's rounding of out (bf16's precision; docs/kernels.md): bf16's tolerance
            for key, tol in (("delta_rel_err", GRAD_TOL), ("lse2_rel_err", ROW_TOL)):
                if not rec[key] < tol:
                    fail(f"{tag}: {key} {rec[key]:.3e} (tolerance {tol})")
                    ok = False
            errs = ", ".join(f"{g} {rec[g + '_rel_err']:.2e}" for g in ("dq", "dk", "dv"))
            vs_ex = ", ".join(f"{rec.get(g + '_vs_existing', float('nan')):.2e}" for g in ("dq", "dk", "dv"))
            own = ", ".join(f"{rec.get(g + '_existing_rel_err', float('nan')):.2e}" for g in ("dq", "dk", "dv"))
            print(f"{'ok  ' if ok else 'BAD '} {tag}: {errs}; vs existing {vs_ex} (existing's own {own}); "
                  f"delta {rec['delta_rel_err']:.1e}, lse2 {rec['lse2_rel_err']:.1e}", flush=True)
        except Exception as e:
            rec["error"] = repr(e)
            fail(f"{tag}: {e!r}")
            traceback.print_exc()
            sync_check(tag + " (after exception)")


# ---------------------------------------------------------------------------------------------- timing

def time_torch(B: int, H: int, T: int, causal: bool, n_sets: int) -> float:
    """PyTorch's SDPA backward alone (torch.autograd.grad on a kept graph), bf16, packed q, k, v."""
    import torch  # type: ignore[import-not-found, unused-ignore]
    import torch.nn.functional as F  # type: ignore[import-not-found, unused-ignore]

    sets = []
    for _ in range(n_sets):
        buf = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = (buf[:, :, i].transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        sets.append((out, buf, torch.randn_like(out)))

    def run(i: int) -> None:
        out, buf, g = sets[i]
        torch.autograd.grad(out, buf, g, retain_graph=True)

    return time_torch_events(run, n_sets)


def time_shape(ours: Ours, names: list[str], B: int, H: int, T: int, causal: bool, rng: Any,
               rows: list[dict[str, Any]]) -> None:
    import cupy as cp

    n_sets = 4
    scale = 1.0 / math.sqrt(D)
    flops = 14.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    sets = []
    for _ in range(n_sets):
        q, k, v, do = make_inputs(B, H, T, True, rng)
        out, lse = production_forward(q, k, v, causal, scale)
        sets.append((q, k, v, out, do, cp.ascontiguousarray(lse, dtype=cp.float32).reshape(B * H, T)))
    (dq, dk, dv), _ = grad_buffers(B, H, T, True)
    lse2 = cp.empty((B * H, T), dtype=cp.float32)
    delta = cp.empty((B * H, T), dtype=cp.float32)
    base: dict[str, Any] = {"shape": [B, H, T], "causal": causal}
    existing_us = torch_us = float("nan")
    try:
        existing_us = time_events(
            lambda i: existing_backward(sets[i][4], *sets[i][:4], sets[i][5], causal, scale), n_sets)
    except Exception as e:
        print(f"existing backward not timed at {B, H, T} causal={causal}: {e!r}", flush=True)
        sync_check("existing timing")
    try:
        torch_us = time_torch(B, H, T, causal, n_sets)
    except Exception as e:
        print(f"torch not timed at {B, H, T} causal={causal}: {e!r}", flush=True)
    for name in names:
        row = dict(base, variant=name, existing_us=existing_us, torch_us=torch_us)
        try:
            us = time_events(lambda i, name=name: ours(name, *sets[i], lse2, delta, dq, dk, dv, causal, scale),
                             n_sets)
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
    args = parse_variants(__doc__, VARIANTS, "check contiguous inputs only at the three small shapes")
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
        write_json(summary, "attention_wgmma_bwd.json")
        return 1
    print(f"built in {time.perf_counter() - t0:.1f} s: {built}", flush=True)
    summary["build"] = built
    ours = Ours()
    for kernel in ("dq", "dkv"):
        for suffix in sorted({VARIANTS[n][0 if kernel == "dq" else 1] for n in names}):
            try:
                attrs = describe_kernel(FAMILY, f"attn_wgmma_bwd_{kernel}_d64_{suffix}", ours.smem(kernel, suffix))
                print(f"  {kernel}_{suffix}: {attrs}", flush=True)
            except Exception as e:
                fail(f"{kernel}_{suffix}: get_function: {e!r}")

    rng = cp.random.default_rng(1234)
    shapes = CHECK_SHAPES[2:] if args.quick else CHECK_SHAPES
    for (B, H, T) in shapes:
        for causal in (True, False):
            for packed in ((False,) if args.quick else (True, False)):
                check_case(ours, names, B, H, T, causal, packed, rng, summary["checks"])
        cp.get_default_memory_pool().free_all_blocks()

    rows: list[dict[str, Any]] = summary["timings"]
    if not args.quick:
        for (B, H, T) in TIME_SHAPES:
            for causal in (True, False):
                time_shape(ours, names, B, H, T, causal, rng, rows)
    write_json(summary, "attention_wgmma_bwd.json")

    errs = {(tuple(c["shape"]), c["causal"], c["variant"]):
            max(c.get(g + "_rel_err", float("nan")) for g in ("dq", "dk", "dv"))
            for c in summary["checks"] if c["packed"] or args.quick}
    print_table("\nattention backward, bf16, D = 64 (us: median device time, dq + dk/dv; TFLOP/s of ours, "
                "14 BHT^2D, half if causal; rel.err: worst of dq, dk, dv)", rows, errs, 8)
    n_ok = sum(1 for c in summary["checks"] if "error" not in c and not c.get("unwritten", 1)
               and all(c.get(g + "_rel_err", 1) < GRAD_TOL for g in ("dq", "dk", "dv")))
    return finish(n_ok, len(summary["checks"]))


if __name__ == "__main__":
    sys.exit(main())
