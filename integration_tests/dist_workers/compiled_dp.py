"""Data-parallel training steps compiled with ``blutrain.compiler`` against the same steps run eagerly, on
whatever world this process is in (``blutrain run -n N``).

Each configuration — ddp with several buckets, ddp with two micro-batches (the first under ``no_sync()``), ddp
averaging its gradients in bf16, ZeRO stages 1, 2 and 3 — trains a tiny GPT-2 for ``STEPS`` AdamW steps twice
from the same weights: eagerly, and through ``compile(step)`` (step 1 eager, step 2 traced, later steps replayed:
the step's collectives are ops of its one compiled program). The learning rate changes every step and the
gradients are clipped, so the replays pick up new scalars and the clip's norm goes through the collectives too.

Then the guard: a compiled function that calls a collective of a plain (undeclared) group must raise a
TracingError naming its line, for a traced value and for a tensor that lives outside the function.

On ``--device cuda`` (nccl, one GPU per rank) the same runs check the compiled step as a CUDA graph: its
collectives captured into the step's one graph on a communication stream, each joined by the first op that
touches its buffers.

Usage: ``compiled_dp.py OUT.json [--device cuda] [RUN ...]`` (``RUN+remat``: compiled with the rematerialize
pass). Rank 0 writes, per configuration, both runs'
losses and gradient norms per step (averaged over ranks), the largest parameter difference after the last step,
and the compiled graph's numbers of traces and collectives; and (on the CPU) the guard's two messages with the
lines they must name.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from compiled_runs import compiled_stats, finish, versus

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.compiler import TracingError, compile
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create, weight_decay_groups
from blutrain_parallel_ddp import DistributedDataParallel
from blutrain_parallel_zero import ZeRO

STEPS = 5
BATCH = 8  # global rows per step
CONFIG = GPT2Config.preset("tiny", vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16)
# on cuda, head size 64: the fused attention kernels, which stream capture takes (CuPy's batched matmul, which a
# generic attention would use, refuses it)
CUDA_CONFIG = GPT2Config.preset("tiny", vocab_size=64, n_layer=2, n_head=2, n_embd=128, block_size=64)
RUNS: dict[str, tuple[str, int, int]] = {  # name → (mode, zero stage, micro-batches)
    "ddp": ("ddp", 0, 1), "ddp-accum2": ("ddp", 0, 2), "ddp-bf16-grads": ("ddp", 0, 1), "zero1": ("zero", 1, 1),
    "zero1-accum2": ("zero", 1, 2), "zero2": ("zero", 2, 1), "zero3": ("zero", 3, 1)}


def train(group: dist.ProcessGroup, mode: str, stage: int, accum: int, compiled: bool,
          device: str = "cpu", grad_dtype: str | None = None, remat: bool | None = None) -> dict[str, Any]:
    bt.manual_seed(1234)
    config = CONFIG if device == "cpu" else CUDA_CONFIG
    net = GPT2(config).to(device=device)
    model: Any
    zero_mode = None
    if mode == "ddp":
        # several buckets: several all-reduces
        model = DistributedDataParallel(net, group, bucket_cap_mb=0.02, grad_dtype=grad_dtype)
    else:
        zero_mode = ZeRO(group, stage=stage, bucket_cap_mb=0.02)  # several buckets, as ddp's
        model = zero_mode.wrap_model(net)
    optimizer: Any = create("adamw", weight_decay_groups(net.parameters(), 0.1), lr=3e-3, betas=(0.9, 0.95))
    if zero_mode is not None:
        optimizer = zero_mode.wrap_optimizer(optimizer)

    def step(batches: list[tuple[bt.Tensor, bt.Tensor]], lr: float) -> tuple[bt.Tensor, bt.Tensor]:
        for g in optimizer.param_groups:
            g["lr"] = lr
        total = bt.zeros((), device=device)
        for i, (x, y) in enumerate(batches):
            local = model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
            with local:
                _, loss = model(x, y)
                (loss / len(batches)).backward()
            total = total + loss.detach() / len(batches)
        norm = optimizer.clip_grad_norm_(1.0) if zero_mode is not None else clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total, norm

    fn: Callable[..., Any] = compile(step, remat=remat) if compiled else step
    losses, norms = [], []
    per_rank = BATCH // group.size
    for s in range(STEPS):
        tokens = np.random.default_rng(s).integers(0, config.vocab_size, (BATCH, config.block_size + 1))
        mine = tokens[group.rank * per_rank:(group.rank + 1) * per_rank]
        batches = [(bt.tensor(p[:, :-1].astype(np.int64), device=device),
                    bt.tensor(p[:, 1:].astype(np.int64), device=device)) for p in np.array_split(mine, accum)]
        loss, norm = fn(batches, 3e-3 * (s + 1) / STEPS)
        both = bt.stack([loss, norm.to(dtype="float32")])
        group.all_reduce(both, op="avg")
        losses.append(float(both[0].item()))
        norms.append(float(both[1].item()))
    state = model.state_dict()  # zero=3 gathers its shards (a collective): every rank calls it
    out: dict[str, Any] = {"losses": losses, "norms": norms,
                           "params": {k: v.detach().cpu().numpy().copy() for k, v in state.items()}}
    if compiled:
        out |= compiled_stats(fn)
    return out


def guard(group: dist.ProcessGroup) -> dict[str, Any]:
    """What compiling a collective of a plain group says, for a traced value and for a state tensor."""
    kept = bt.ones(4)
    messages: dict[str, Any] = {}

    def traced_value(x: bt.Tensor) -> bt.Tensor:
        y = x * 2.0
        group.all_reduce(y)  # GUARD-TRACED
        return y

    def state_tensor(x: bt.Tensor) -> bt.Tensor:
        group.all_reduce(kept)  # GUARD-STATE
        return x * kept

    for name, f in (("traced", traced_value), ("state", state_tensor)):
        try:
            compile(f, warmup=0)(bt.ones(4))
            messages[name] = None
        except TracingError as exc:
            messages[name] = str(exc)
    source = Path(__file__).read_text().splitlines()
    messages["lines"] = {name: next(i + 1 for i, line in enumerate(source) if line.endswith(f"# GUARD-{tag}"))
                         for name, tag in (("traced", "TRACED"), ("state", "STATE"))}
    return messages


def main() -> int:
    args = sys.argv[2:]
    device = "cpu"
    if args[:1] == ["--device"]:
        device, args = args[1], args[2:]
    group = dist.init_process_group("nccl" if device == "cuda" else "mpi")
    if device == "cuda":  # the nccl group uses this rank's GPU
        device = f"cuda:{dist.detect().local_rank}"
    results: dict[str, Any] = {"world": group.size}
    for name in args or list(RUNS):
        base, _, option = name.partition("+")  # NAME+remat: compiled with the rematerialize pass
        mode, stage, accum = RUNS[base]
        grad_dtype = "bf16" if base == "ddp-bf16-grads" else None
        eager = train(group, mode, stage, accum, compiled=False, device=device, grad_dtype=grad_dtype)
        compiled = train(group, mode, stage, accum, compiled=True, device=device, grad_dtype=grad_dtype,
                         remat=option == "remat" or None)
        results[name] = versus(group, eager, compiled,
                               ((eager["params"][k], compiled["params"][k]) for k in eager["params"]), device)
    if device == "cpu":
        results["guard"] = guard(group)
    return finish(group, results, sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
