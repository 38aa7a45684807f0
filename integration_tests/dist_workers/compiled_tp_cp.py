"""Tensor- and context-parallel training steps compiled with ``blutrain.compiler`` against the same steps run
eagerly, on 4 ranks (``blutrain run -n 4``) laid out as a 2 × 2 mesh.

Each configuration trains a tiny GPT-2 for ``STEPS`` AdamW steps twice from the same weights: eagerly, and
through ``compile(step)`` (step 1 eager, step 2 traced, later steps replayed: the mode's collectives are ops of
the step's one compiled program). The learning rate changes every step and the gradients are clipped with the
mode's global norm, so replays pick up new scalars and the norm's all-reduce is one of the collectives too.

- ``tp``, ``tp-async``: tp = 2 over the mesh's "tp" groups (each pair of ranks is one tensor-parallel job;
  ``-async``: async TP in ``ASYNC_CHUNKS`` row blocks); ``dp-tp``: ddp over "dp" around it.
- ``cp-<attn>``: cp = 2 over the mesh's "cp" groups with ring, all-gather or Ulysses attention (the cp mode
  averages the gradients over the cp group); ``dp-cp-<attn>``: ddp over dp × cp around it.
- ``tpcp-<attn>``: cp = 2 × tp = 2, context parallelism over the tensor-parallel model (cp averages the shards'
  gradients over its group, tp gives the norm).
- ``<config>+remat``: compiled with the rematerialize pass (``compile(step, remat=True)``).

Usage: ``compiled_tp_cp.py OUT.json [CONFIG ...]``. Rank 0 writes, per configuration, both runs' losses and
norms per step, the largest difference of any parameter over the ranks' (own shards of the) parameters, and
the compiled graph's numbers of traces and collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from compiled_runs import compiled_stats, finish, versus

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.compiler import compile
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups

STEPS = 5
BATCH = 4  # rows per data-parallel rank (the global batch: 4 × dp)
ASYNC_CHUNKS = 3
CONFIG = GPT2Config.preset("tiny", vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=16)
CONFIGS = ["tp", "tp-async", "dp-tp", "cp-ring", "cp-allgather", "cp-ulysses", "dp-cp-ring", "dp-cp-ulysses",
           "tpcp-ring", "tpcp-ulysses"]


def train(world: dist.ProcessGroup, config: str, compiled: bool) -> dict[str, Any]:
    from blutrain_parallel_cp import CP
    from blutrain_parallel_ddp import DDP
    from blutrain_parallel_tp import TP

    config, _, option = config.partition("+")
    kind, _, attn = config.partition("-")
    with_dp = kind == "dp"
    if with_dp:
        kind, _, attn = attn.partition("-")
    mesh = dist.DeviceMesh(world, {"cp": 2, "tp": 2} if kind == "tpcp" else {"dp": 2, kind: 2})
    bt.manual_seed(1234)
    net = GPT2(CONFIG)
    model: Any
    if kind == "tpcp":
        model = norm_source = TP(mesh).wrap_model(net)
        model = CP(mesh, attn=attn).wrap_model(model)
    elif kind == "tp":
        # without ddp each tp pair is its own job, and takes its own group (not the mesh with its dp dimension)
        model = TP(mesh if with_dp else mesh.get_group("tp"), async_chunks=ASYNC_CHUNKS if attn == "async" else 0)
        model = model.wrap_model(net)
    else:
        model = CP(mesh if with_dp else mesh.get_group("cp"), attn=attn).wrap_model(net)
    if kind != "tpcp":
        norm_source = model if kind == "tp" else None
    if with_dp:
        model = DDP(mesh, bucket_cap_mb=0.02).wrap_model(model)
    dp_rank = mesh.local_rank("dp") if with_dp else 0
    optimizer: Any = create("adamw", weight_decay_groups(net.parameters(), 0.1), lr=3e-3, betas=(0.9, 0.95))

    def step(x: bt.Tensor, y: bt.Tensor, lr: float) -> tuple[bt.Tensor, bt.Tensor]:
        for g in optimizer.param_groups:
            g["lr"] = lr
        _, loss = model(x, y)
        loss.backward()
        norm = norm_source.clip_grad_norm_(1.0) if norm_source is not None else clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm

    fn: Callable[..., Any] = compile(step, remat=option == "remat" or None) if compiled else step
    losses, norms = [], []
    for s in range(STEPS):
        tokens = np.random.default_rng(s).integers(0, CONFIG.vocab_size, (2 * BATCH, CONFIG.block_size + 1))
        mine = tokens[dp_rank * BATCH:(dp_rank + 1) * BATCH] if with_dp else tokens[:BATCH]
        x, y = bt.tensor(mine[:, :-1].astype(np.int64)), bt.tensor(mine[:, 1:].astype(np.int64))
        loss, norm = fn(x, y, 3e-3 * (s + 1) / STEPS)
        both = bt.stack([loss.to(dtype="float32"), norm.to(dtype="float32")])
        world.all_reduce(both, op="avg")
        losses.append(float(both[0].item()))
        norms.append(float(both[1].item()))
    out: dict[str, Any] = {"losses": losses, "norms": norms,
                           "params": [p.detach().numpy().copy() for p in net.parameters()]}
    if compiled:
        out |= compiled_stats(fn)
    return out


def main() -> int:
    world = dist.init_process_group("mpi")
    results: dict[str, Any] = {"world": world.size}
    for config in sys.argv[2:] or CONFIGS:
        eager = train(world, config, compiled=False)
        compiled = train(world, config, compiled=True)
        results[config] = versus(world, eager, compiled, zip(eager["params"], compiled["params"], strict=True))
    return finish(world, results, sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
