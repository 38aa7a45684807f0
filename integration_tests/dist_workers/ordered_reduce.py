"""``reduce=ordered`` (ddp and ZeRO) against one process accumulating the ranks' micro-batches, on whatever world
this process is in (``blutrain run -n N``).

Every rank trains a tiny GPT-2 twice from the same weights for ``STEPS`` AdamW steps: under the mode with
``reduce="ordered"``, one micro-batch per rank; and alone, with no group at all, as one process that accumulates
the N micro-batches of each step in rank order (each loss scaled by 1/N, as ``blutrain train`` accumulates). The
single-process reference runs in the rank's own process, so both use the same kernels with the same threads.
Each micro-batch's loss (gathered over the ranks for the parallel run) and every final parameter are compared
for exact equality on every rank. ddp runs clip the gradients (both runs compute the same norm from the same
gradients); ZeRO runs do not (ZeRO sums the norm over its shards, so a clipped update rounds differently).

Runs (``RUN`` arguments; default all of ``RUNS``): ``MODE-PRECISION-IMPL`` with MODE ``ddp``, ``zero1``,
``zero2`` or ``zero3``, PRECISION ``fp32`` or ``bf16`` (bf16 autocast, float32 weights and gradients), IMPL
``eager`` or ``compiled``; ``+backend`` runs the mode's default reduction instead (reported, for contrast). The
model's vocabulary (65) and width (27) make tensors whose sizes are not multiples of 2 or 4, and the bucket cap
holds about one of them per bucket, so most buckets are padded to a multiple of the group size.

Usage: ``ordered_reduce.py OUT.json [RUN ...]``. Rank 0 writes, per run: the losses of both trainings (one list
of N per step), the number of parameter elements that differ on any rank and the largest difference, the
buckets' element counts, and the compiled step's numbers of traces and collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from compiled_runs import compiled_stats, finish

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.compiler import compile
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups
from blutrain_parallel_ddp import DistributedDataParallel
from blutrain_parallel_zero import ZeRO

STEPS = 4
ROWS = 2  # rows per micro-batch (one micro-batch per rank)
CONFIG = GPT2Config.preset("tiny", vocab_size=65, n_layer=2, n_head=3, n_embd=27, block_size=12)
BUCKET_CAP_MB = 0.004  # ~1000 float32 values: a bucket holds one or two tensors
RUNS = ("ddp-fp32-eager", "ddp-fp32-compiled", "ddp-bf16-eager", "ddp-bf16-compiled", "zero1-fp32-eager",
        "zero2-fp32-eager", "zero2-fp32-compiled", "zero3-fp32-eager")


def micro_batches(step: int, n: int) -> list[tuple[bt.Tensor, bt.Tensor]]:
    """The step's N micro-batches, micro-batch r being rank r's rows."""
    tokens = np.random.default_rng(step).integers(0, CONFIG.vocab_size, (n * ROWS, CONFIG.block_size + 1))
    return [(bt.tensor(tokens[r * ROWS:(r + 1) * ROWS, :-1].astype(np.int64)),
             bt.tensor(tokens[r * ROWS:(r + 1) * ROWS, 1:].astype(np.int64))) for r in range(n)]


def train(group: dist.ProcessGroup | None, n: int, mode: str, precision: str, compiled: bool,
          reduce: str = "ordered") -> dict[str, Any]:
    """``STEPS`` steps: under ``mode`` over ``group`` (this rank's micro-batch), or (``group`` None) one process
    accumulating all ``n`` micro-batches, clipping where ``mode`` is ddp. Losses per step (this process's
    micro-batches) and final parameters."""
    bt.manual_seed(1234)
    net = GPT2(CONFIG)
    model: Any = net
    optimizer: Any = create("adamw", weight_decay_groups(net.parameters(), 0.1), lr=3e-3, betas=(0.9, 0.95))
    if group is not None and mode == "ddp":
        model = DistributedDataParallel(net, group, bucket_cap_mb=BUCKET_CAP_MB, reduce=reduce)
    elif group is not None:
        zero = ZeRO(group, stage=int(mode[-1]), bucket_cap_mb=BUCKET_CAP_MB, reduce=reduce)
        model = zero.wrap_model(net)
        optimizer = zero.wrap_optimizer(optimizer)
    clip = mode == "ddp"
    autocast = bt.autocast(dtype="bfloat16", enabled=precision == "bf16")

    def step(batches: list[tuple[bt.Tensor, bt.Tensor]], lr: float) -> bt.Tensor:
        for g in optimizer.param_groups:
            g["lr"] = lr
        losses = []
        for x, y in batches:  # in parallel: one micro-batch; alone: n, accumulated into .grad in order
            with autocast:
                _, loss = model(x, y)
            (loss / len(batches)).backward()
            losses.append(loss.detach().to(dtype="float32"))
        if clip:
            clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return bt.stack(losses)

    fn: Callable[..., Any] = compile(step) if compiled else step
    losses: list[list[float]] = []
    for s in range(STEPS):
        batches = micro_batches(s, n)
        mine = batches if group is None else [batches[group.rank]]
        step_losses = fn(mine, 3e-3 * (s + 1) / STEPS)
        if group is not None:  # every rank's micro-batch loss, in rank order
            every = bt.zeros(n)
            group.all_gather_into_tensor(every, step_losses)
            step_losses = every
        losses.append([float(v) for v in step_losses.numpy()])
    state = (net if mode == "ddp" else model).state_dict()  # ZeRO: whole tensors, unwrapped names (collective)
    out: dict[str, Any] = {"losses": losses, "params": {k: v.detach().numpy().copy() for k, v in state.items()}}
    if group is not None:
        out["buckets"] = ([sum(p.numel() for p in b.params) for b in model.buckets] if mode == "ddp"
                          else [b.numel for b in model.buckets])
    if compiled:
        out |= compiled_stats(fn)
    return out


def compare(group: dist.ProcessGroup, name: str) -> dict[str, Any]:
    base, _, reduce = name.partition("+")
    mode, precision, impl = base.split("-")
    compiled = impl == "compiled"
    parallel = train(group, group.size, mode, precision, compiled, reduce or "ordered")
    alone = train(None, group.size, mode, precision, compiled)
    pairs = [(parallel["params"][k], alone["params"][k]) for k in alone["params"]]
    # over every rank: elements that differ at all, and the largest difference
    counts = bt.tensor([float(sum(int(np.count_nonzero(a != b)) for a, b in pairs)),
                        max(float(np.abs(a - b).max()) for a, b in pairs)], dtype="float64")
    group.all_reduce(counts, op="max")
    return {"parallel": {k: v for k, v in parallel.items() if k != "params"}, "alone": {"losses": alone["losses"]},
            "params_differing": int(counts[0].item()), "param_max_diff": float(counts[1].item()),
            "elements": sum(a.size for a, _ in pairs)}


def main() -> int:
    group = dist.init_process_group("mpi")
    results: dict[str, Any] = {"world": group.size}
    for name in sys.argv[2:] or RUNS:
        results[name] = compare(group, name)
    return finish(group, results, sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
