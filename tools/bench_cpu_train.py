"""CPU training throughput of a GPT-2 preset: BluTrain against PyTorch's CPU build, same shapes.

PyTorch is not part of the workspace lock; install its CPU build beside BluTrain to run this:
``pip install torch==2.13.0``. Both sides train the same architecture (pre-LN GPT-2, tied head,
GELU-tanh, AdamW with nanoGPT's decay groups) on the same random tokens; steps alternate
between the frameworks after a warm-up, and the table reports the median over timed steps.

    python tools/bench_cpu_train.py --preset tiny --batch-size 16 --seq-len 128 --steps 20
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np


def _blutrain_step_fn(cfg: Any, batch: int, seq: int, lr: float) -> Any:
    import blutrain.tensor as bt
    from blutrain.models.gpt2 import GPT2
    from blutrain.optim import create

    bt.manual_seed(0)
    model = GPT2(cfg)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = create("adamw", [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=lr)

    def step(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> float:
        opt.zero_grad(set_to_none=True)
        _, loss = model(bt.from_numpy(x), bt.from_numpy(y))
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def _torch_step_fn(cfg: Any, batch: int, seq: int, lr: float) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(cfg.n_embd)
            self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
            self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
            self.ln_2 = nn.LayerNorm(cfg.n_embd)
            self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
            self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            h = cfg.n_head
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.h = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=lr)

    def step(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per framework")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("tools/results/bench_cpu_train.json"))
    args = ap.parse_args()

    from blutrain.models.gpt2 import GPT2Config

    cfg = GPT2Config.preset(args.preset)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, size=(2, args.batch_size, args.seq_len), dtype=np.int64)
               for _ in range(args.warmup + args.steps)]
    steps = {"blutrain": _blutrain_step_fn(cfg, args.batch_size, args.seq_len, 1e-3)}
    try:
        import torch

        steps["pytorch"] = _torch_step_fn(cfg, args.batch_size, args.seq_len, 1e-3)
        torch_version = torch.__version__
        threads = torch.get_num_threads()
    except ImportError:
        print("PyTorch is not installed: pip install torch==2.13.0 (CPU build) to compare; timing BluTrain only")
        torch_version, threads = None, None
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i, b in enumerate(batches):
        for name, fn in steps.items():  # alternate frameworks step by step
            t0 = time.perf_counter()
            loss = fn(b[0], b[1])
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise SystemExit(f"{name}: non-finite loss at step {i}")
            if i >= args.warmup:
                times[name].append(dt)
    tokens = args.batch_size * args.seq_len
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"framework": name, "step_ms": med * 1e3, "tokens_per_s": tokens / med})
    result = {"preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
              "torch_version": torch_version, "torch_threads": threads, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nGPT-2 '{args.preset}' on the CPU, {args.batch_size}×{args.seq_len} tokens/step, "
          f"median of {args.steps} steps (torch {torch_version}, {threads} threads)")
    print(f"{'framework':<10} {'step ms':>10} {'tokens/s':>12} {'vs pytorch':>11}")
    base = next((r["tokens_per_s"] for r in rows if r["framework"] == "pytorch"), None)
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}×" if base else "-"
        print(f"{r['framework']:<10} {r['step_ms']:>10.1f} {r['tokens_per_s']:>12,.0f} {ratio:>11}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
