"""A few AdamW steps of a tiny GPT-2 under the "zero" mode at each of ``--stages``, on whatever world this process
is in (one launch trains every stage in turn, each from freshly built weights).

Run alone it is a one-rank group; under ``blutrain run -n N`` each rank trains on its slice of the same
global batch. Gradients are clipped (at a norm the first steps exceed) through the sharded optimizer, so
the global norm over every rank's shard is exercised. Rank 0 writes the per-step global losses, the norms
and the final parameters (whole, from ``state_dict``: stage 3 gathers them) to ``OUT.STAGE.json`` and
``OUT.STAGE.npz``. Ranks other than 0 start from different random weights, so matching results also
prove the initial broadcast. ``--save DIR`` also writes every rank's state shard of the last stage
(``shard.RANK.npz``, ``shard.RANK.json``); ``--load DIR`` merges the shards found there and loads them
before training (``--first`` then names the step it resumes at). Stage 0 runs the plain model and
optimizer: the single-process reference. ``--checkpoint-activations`` recomputes every block in backward
(stage 3 then gathers a block's parameters three times a step: forward, recomputation, backward).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups
from blutrain_parallel_zero import ZeRO

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stages", default="2", help="comma-separated ZeRO stages; 0 runs the plain model")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--first", type=int, default=0, help="the first step's index (its tokens)")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--save", default=None)
parser.add_argument("--snapshot", type=int, default=0, help="also write the parameters after this many steps")
parser.add_argument("--load", default=None)
parser.add_argument("--checkpoint-activations", action="store_true", help="recompute each block in backward")
args = parser.parse_args()

group = dist.init_process_group("mpi")
rank, world = group.rank, group.size
config = GPT2Config.preset("tiny", n_layer=2, n_head=2, n_embd=32, block_size=16,
                           checkpoint_activations=args.checkpoint_activations)


def read_shard(path: Path, r: int) -> dist.StateShard:
    meta = json.loads((path / f"shard.{r}.json").read_text())
    arrays = np.load(path / f"shard.{r}.npz")
    tensors = {k: bt.tensor(arrays[k]) for k in arrays.files}
    params = {n: tensors[f"p/{n}"] for n in meta["layout"]["ranges"]}
    optim = {n: {k: (tensors[f"o/{n}/{k}"] if v == "__tensor__" else v) for k, v in entry.items()}
             for n, entry in meta["optimizer"].items()}
    return dist.StateShard.from_layout(meta["layout"], params, optim, where=f"shard {r}")


def write_shard(shard: dist.StateShard, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {f"p/{n}": t.numpy() for n, t in shard.params.items()}
    optim_meta: dict[str, dict[str, Any]] = {}
    for n, entry in shard.optimizer.items():
        optim_meta[n] = {}
        for k, v in entry.items():
            if isinstance(v, bt.Tensor):
                arrays[f"o/{n}/{k}"] = v.numpy()
                optim_meta[n][k] = "__tensor__"
            else:
                optim_meta[n][k] = v
    np.savez(out / f"shard.{rank}.npz", **arrays)
    (out / f"shard.{rank}.json").write_text(json.dumps({"layout": shard.layout(), "optimizer": optim_meta}))


def train(stage: int, save: str | None) -> None:
    bt.manual_seed(1234 + rank)
    net = GPT2(config)
    optimizer: Any = create("adamw", weight_decay_groups(net.parameters(), 0.1), lr=3e-3)
    model: Any = net
    if stage:
        mode = ZeRO(group, stage=stage, bucket_cap_mb=0.02)  # several buckets in stages 1 and 2
        model = mode.wrap_model(net)
        optimizer = mode.wrap_optimizer(optimizer)
    if args.load:
        path = Path(args.load)
        count = len(list(path.glob("shard.*.json")))
        full, optim_state = dist.merge_shards([read_shard(path, r) for r in range(count)])
        model.load_state_dict(full)
        optimizer.load_state_dict(optim_state)
    per_rank = args.batch // world
    losses, norms = [], []
    for step in range(args.first, args.first + args.steps):
        tokens = np.random.default_rng(step).integers(0, config.vocab_size, (args.batch, config.block_size + 1))
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        x = bt.tensor(mine[:, :-1].astype(np.int64))
        y = bt.tensor(mine[:, 1:].astype(np.int64))
        _, loss = model(x, y)
        loss.backward()
        norm = optimizer.clip_grad_norm_(0.5) if stage else clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        mean = bt.tensor([float(loss.item())], dtype="float64")
        group.all_reduce(mean, op="avg")
        losses.append(float(mean.numpy()[0]))
        norms.append(float(norm.item()))
        if len(losses) == args.snapshot:
            snapshot = model.state_dict()
            if rank == 0:
                np.savez(f"{args.out}.{stage}.after{len(losses)}.npz", **{n: t.numpy() for n, t in snapshot.items()})
    if save:
        write_shard(optimizer.state_shard(), Path(save))
    state = model.state_dict()  # collective in stage 3
    if rank == 0:
        np.savez(f"{args.out}.{stage}.npz", **{n: t.numpy() for n, t in state.items()})
        with open(f"{args.out}.{stage}.json", "w") as f:
            json.dump({"losses": losses, "norms": norms, "world": world}, f)


stages = [int(s) for s in args.stages.split(",")]
for i, stage in enumerate(stages):
    train(stage, args.save if i == len(stages) - 1 else None)
dist.destroy_process_group()
