"""A few AdamW steps of a tiny GPT-2 under the "ddp" mode, on whatever world this process is in.

Run alone it is the single-process reference; under ``blutrain run -n N`` each rank trains on its
slice of the same global batch. Rank 0 writes the per-step global losses and the final parameters.
Ranks other than 0 start from different random weights, so matching results also prove the initial
broadcast. ``--accum 2`` splits each rank's slice in two micro-batches, the first under ``no_sync()``.
``--grad-dtype bf16`` averages the gradients in bfloat16 (the float32 gradients are kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import create
from blutrain_parallel_ddp import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--grad-dtype", default=None)
args = parser.parse_args()

group = dist.init_process_group("mpi")
rank, world = group.rank, group.size
bt.manual_seed(1234 + rank)
config = GPT2Config.preset("tiny", n_layer=2, n_head=2, n_embd=32, block_size=16)
model = GPT2(config)
# a small bucket cap gives several buckets, so launch order and overlap are exercised
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.02, grad_dtype=args.grad_dtype)
optimizer = create("adamw", list(ddp.parameters()), lr=3e-3, weight_decay=0.1)

per_rank = args.batch // world
losses = []
for step in range(args.steps):
    tokens = np.random.default_rng(step).integers(0, config.vocab_size, (args.batch, config.block_size + 1))
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    micro = np.array_split(mine, args.accum)
    total = 0.0
    for i, part in enumerate(micro):
        x = bt.tensor(part[:, :-1].astype(np.int64))
        y = bt.tensor(part[:, 1:].astype(np.int64))
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            _, loss = ddp(x, y)
            (loss / len(micro)).backward()
        total += float(loss.item()) / len(micro)
    optimizer.step()
    optimizer.zero_grad()
    mean = bt.tensor([total], dtype="float64")
    group.all_reduce(mean, op="avg")
    losses.append(float(mean.numpy()[0]))

if rank == 0:
    np.savez(args.out + ".npz", **{n: p.detach().numpy() for n, p in model.named_parameters()})
    with open(args.out + ".json", "w") as f:
        json.dump({"losses": losses, "world": world, "buckets": len(ddp.buckets),
                   "grad_dtypes": sorted({p.grad.dtype.name for p in model.parameters() if p.grad is not None}
                                         | {p.dtype.name for p in model.parameters()})}, f)
dist.destroy_process_group()
