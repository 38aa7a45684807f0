"""GPT-2 124M on device cuda against the same weights in float64 on the CPU.

One forward/backward of the gpt2-124m preset on the GPU in float32 and again under bf16 autocast
(bf16 GEMMs and attention, float32 master weights), and in float64 on the CPU, from identical weights
and tokens; prints the relative error of the loss and the worst relative error (‖Δ‖/‖g‖) over all
parameter gradients, and fails (exit 1) above 1e-4 for float32 or 1e-2 for bf16. Where PyTorch is installed,
its bf16 autocast of the same weights and tokens (tools/bench/gpt2.py's reference model) is measured against
the same float64 gradients and printed beside, so that bf16's own error is told apart from BluTrain's.

    python tools/check_gpt2_cuda.py --batch-size 2 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import blutrain.tensor as bt
    from blutrain.models.gpt2 import GPT2, GPT2Config

    bt.manual_seed(0)
    cfg = GPT2Config.preset(args.preset)
    ref = GPT2(cfg).to(dtype="float64")
    gpu = GPT2(cfg)
    gpu.load_state_dict({k: v.to(dtype="float32") for k, v in ref.state_dict().items()})
    gpu.to("cuda")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=(args.batch_size, args.seq_len + 1), dtype=np.int64)
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()

    def gpu_step(autocast: bool) -> tuple[float, dict[str, np.ndarray], float]:
        gpu.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with bt.autocast(dtype="bfloat16", enabled=autocast):
            # the training path: the head and loss fused (linear_cross_entropy)
            _, loss = gpu(bt.from_numpy(x).to("cuda"), bt.from_numpy(y).to("cuda"), return_logits=False)
        loss.backward()
        bt.get_backend("cuda").synchronize(0)
        seconds = time.perf_counter() - t0
        grads = {n: np.asarray(p.grad.cpu().numpy(), dtype=np.float64) for n, p in gpu.named_parameters()}
        return float(loss.item()), grads, seconds

    loss_fp32, grads_fp32, t_fp32 = gpu_step(autocast=False)
    loss_bf16, grads_bf16, t_bf16 = gpu_step(autocast=True)
    t0 = time.perf_counter()
    _, loss_ref_t = ref(bt.from_numpy(x), bt.from_numpy(y))
    loss_ref_t.backward()
    t_cpu = time.perf_counter() - t0
    loss_ref = float(loss_ref_t.item())
    ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}

    def compare(loss: float, grads: dict[str, np.ndarray]) -> tuple[float, float, str]:
        worst, worst_name = 0.0, ""
        for name, g in grads.items():
            r = ref_grads[name]
            err = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
            if err > worst:
                worst, worst_name = err, name
        return abs(loss - loss_ref) / abs(loss_ref), worst, worst_name

    def overall(grads: dict[str, np.ndarray]) -> float:
        """‖Δ‖/‖g‖ over all gradients as one vector (context beside the per-parameter worst)."""
        diff = math.sqrt(sum(float(np.sum((g - ref_grads[n]) ** 2)) for n, g in grads.items()))
        return diff / math.sqrt(sum(float(np.sum(r ** 2)) for r in ref_grads.values()))

    result: dict[str, object] = {"preset": args.preset, "batch": args.batch_size, "seq_len": args.seq_len,
                                 "loss_cpu_fp64": loss_ref, "seconds_cpu": t_cpu}
    torch_bf16 = torch_autocast_step(cfg, ref, x, y)
    if torch_bf16 is not None:
        loss_err, worst, worst_name = compare(*torch_bf16)
        result["torch_bf16"] = {"loss": torch_bf16[0], "loss_rel_err": loss_err, "worst_grad_rel_err": worst,
                                "worst_grad": worst_name, "all_grads_rel_err": overall(torch_bf16[1])}
        print(f"GPT-2 {args.preset} {args.batch_size}x{args.seq_len}: PyTorch bf16 autocast, same weights: loss rel "
              f"{loss_err:.1e}; worst gradient rel. error {worst:.1e} ({worst_name}), all gradients "
              f"{overall(torch_bf16[1]):.1e} (context, not checked)")
    ok = True
    for mode, loss, grads, seconds, limit in (("fp32", loss_fp32, grads_fp32, t_fp32, 1e-4),
                                              ("bf16", loss_bf16, grads_bf16, t_bf16, 1e-2)):
        loss_err, worst, worst_name = compare(loss, grads)
        passed = loss_err < limit and worst < limit
        ok &= passed
        result[mode] = {"loss": loss, "loss_rel_err": loss_err, "worst_grad_rel_err": worst,
                        "worst_grad": worst_name, "all_grads_rel_err": overall(grads), "seconds": seconds,
                        "limit": limit, "pass": passed}
        print(f"GPT-2 {args.preset} {args.batch_size}x{args.seq_len}: loss cuda {mode} {loss:.6f} vs cpu fp64 "
              f"{loss_ref:.6f} (rel {loss_err:.1e}); worst gradient rel. error {worst:.1e} ({worst_name}), all "
              f"gradients {overall(grads):.1e} -> {'PASS' if passed else 'FAIL'} (limit {limit:.0e} on the worst)")
    result["pass"] = ok
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


def torch_autocast_step(cfg: object, ref: object, x: np.ndarray, y: np.ndarray,
                        ) -> tuple[float, dict[str, np.ndarray]] | None:
    """PyTorch's bf16 autocast forward/backward of ``ref``'s weights (float32 master copy) on the GPU, or None
    when PyTorch or its CUDA build is not there."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: the benchmark's modules import as bench.*
    from bench.gpt2_models import torch_reference  # the benchmark's reference model, BluTrain's parameter names

    model = torch_reference(cfg).cuda()
    state = {k: torch.from_numpy(np.asarray(v.numpy(), dtype=np.float32)) for k, v in ref.state_dict().items()}
    loaded = model.load_state_dict(state, strict=False)
    missing = set(loaded.missing_keys) - {"lm_head.weight"}  # the tied LM head is the token embedding
    if missing or loaded.unexpected_keys:
        raise SystemExit(f"PyTorch reference: weights not mapped (missing {sorted(missing)}, unexpected "
                         f"{loaded.unexpected_keys})")
    xt, yt = (torch.from_numpy(a).cuda() for a in (x, y))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(xt, yt)
    loss.backward()
    grads = {n: p.grad.double().cpu().numpy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.item()), grads


if __name__ == "__main__":
    sys.exit(main())
