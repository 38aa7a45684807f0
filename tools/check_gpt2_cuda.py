"""GPT-2 124M on device cuda against the same weights in float64 on the CPU.

One forward/backward of the gpt2-124m preset in float32 on the GPU and in float64 on the CPU, from
identical weights and tokens; prints the relative error of the loss and the worst relative error
(‖Δ‖/‖g‖) over all parameter gradients, and fails (exit 1) above 1e-4.

    python tools/check_gpt2_cuda.py --batch-size 2 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
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

    t0 = time.perf_counter()
    _, loss_gpu = gpu(bt.from_numpy(x).to("cuda"), bt.from_numpy(y).to("cuda"))
    loss_gpu.backward()
    bt.get_backend("cuda").synchronize(0)
    t_gpu = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, loss_ref = ref(bt.from_numpy(x), bt.from_numpy(y))
    loss_ref.backward()
    t_cpu = time.perf_counter() - t0

    loss_err = abs(loss_gpu.item() - loss_ref.item()) / abs(loss_ref.item())
    worst, worst_name = 0.0, ""
    ref_params = dict(ref.named_parameters())
    for name, p in gpu.named_parameters():
        g = np.asarray(p.grad.cpu().numpy(), dtype=np.float64)
        r = ref_params[name].grad.numpy()
        err = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
        if err > worst:
            worst, worst_name = err, name
    ok = loss_err < 1e-4 and worst < 1e-4
    result = {"preset": args.preset, "batch": args.batch_size, "seq_len": args.seq_len,
              "loss_cuda_fp32": loss_gpu.item(), "loss_cpu_fp64": loss_ref.item(), "loss_rel_err": loss_err,
              "worst_grad_rel_err": worst, "worst_grad": worst_name, "seconds_cuda": t_gpu, "seconds_cpu": t_cpu,
              "pass": ok}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(f"GPT-2 {args.preset} {args.batch_size}x{args.seq_len}: loss cuda fp32 {loss_gpu.item():.6f} vs cpu fp64 "
          f"{loss_ref.item():.6f} (rel {loss_err:.1e}); worst gradient rel. error {worst:.1e} ({worst_name}) "
          f"-> {'PASS' if ok else 'FAIL'} (limit 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
