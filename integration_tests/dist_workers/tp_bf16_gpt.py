"""Tensor parallelism in bfloat16 autocast on a GPT-2 with GPT-2 774M's shape properties at tp = 4.

At tp = 4 the 774M preset leaves each rank 5 heads (an odd count) of 64 dims, 320 of the 1280 hidden
features and 12576 of the padded vocabulary's 50304 rows (not a multiple of 64). ``CONFIG`` keeps each of
those properties at a size two CPU cores train in seconds: 20 heads (5 per rank at tp = 4), 1280 / 4 = 320
features cut to 320 / 4 = 80 per rank, and a vocabulary of 6288 = 16 · 393 (1572 rows per rank, as 50304 =
128 · 393 leaves 12576). ``train(group)`` runs ``STEPS`` training steps as ``blutrain train --dtype bf16``
does them (the forward and loss under ``autocast(bfloat16)``, the global-norm clip, AdamW with float32 master
weights) and returns, per step, the loss, its dtype name and the gradient norm before clipping, plus the
first step's gradients and the final parameters in their single-process shapes. ``group`` None: the
single-process GPT2; else ``TP`` over the group (``async_chunks`` > 0: async TP).

Under ``blutrain run -n N -- python tp_bf16_gpt.py OUT [DEVICE]`` (DEVICE ``cpu``, MPI, the default; or
``cuda``, one GPU a rank, NCCL) rank 0 writes, for each configuration of
``CONFIGS`` (sync and async TP), ``OUT.<config>.json`` (the steps) and ``OUT.<config>.npz`` (``grad/<name>``
and ``param/<name>``); the test imports this file for the single-process run.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create

CONFIG = {"n_layer": 2, "n_head": 20, "n_embd": 320, "block_size": 32, "vocab_size": 6288}
STEPS, BATCH, CLIP = 3, 4, 1.0
CONFIGS = {"tp": 0, "tp-async": 3}  # async TP in 3 uneven row blocks of the 128 rows


def batch(step: int, device: str) -> tuple[bt.Tensor, bt.Tensor]:
    """Targets over the whole vocabulary, so every rank's shard owns some of them."""
    tokens = np.random.default_rng(100 + step).integers(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1))
    return (bt.tensor(tokens[:, :-1].astype(np.int64)).to(device),
            bt.tensor(tokens[:, 1:].astype(np.int64)).to(device))


def host(t: bt.Tensor) -> np.ndarray[Any, Any]:
    """A host copy (the clip scales gradients in place after they are read)."""
    return np.array(t.detach().to("cpu").numpy(), copy=True)


def full_gradients(wrapped: Any, group: Any) -> dict[str, np.ndarray[Any, Any]]:
    """Every parameter's gradient in its single-process shape: the parallel layers' shards gathered."""
    from blutrain_parallel_tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_shard

    out: dict[str, np.ndarray[Any, Any]] = {}
    seen: set[int] = set()  # the tied head's weight is the token embedding's, listed once as in parameters()
    for prefix, module in wrapped.module.named_modules():
        cuts = module.shards() if isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)) else {}
        for name, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                out[key] = host(gather_shard(p.grad, cuts[name], group) if name in cuts else p.grad)
    return out


def train(group: Any = None, async_chunks: int = 0, device: str = "cpu") -> dict[str, Any]:
    bt.manual_seed(4321 + (group.rank if group is not None else 0))  # ranks differ: the broadcast must win
    model = GPT2(GPT2Config.preset("gpt2-774m", **CONFIG)).to(device)
    wrapped: Any = model
    if group is not None:
        from blutrain_parallel_tp import TP

        wrapped = TP(group, async_chunks=async_chunks).wrap_model(model)
    optimizer = create("adamw", list(wrapped.parameters()), lr=3e-3, weight_decay=0.1)
    autocast = bt.autocast(dtype="bfloat16")
    steps: list[dict[str, Any]] = []
    grads: dict[str, np.ndarray[Any, Any]] = {}
    for step in range(STEPS):
        x, y = batch(step, device)
        with autocast:
            _, loss = wrapped(x, y)
        loss.backward()
        if step == 0:
            if group is not None:
                grads = full_gradients(wrapped, group)
            else:
                grads = {n: host(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        norm = wrapped.clip_grad_norm_(CLIP) if group is not None else clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": float(loss.item()), "dtype": loss.dtype.name, "norm": float(norm.item())})
    params = wrapped.full_parameters() if group is not None else dict(model.named_parameters())
    return {"steps": steps, "grads": grads, "params": {n: host(p) for n, p in params.items()}}


def main(out: str, device: str) -> None:
    if device == "cuda":  # one GPU a rank, NCCL
        device = f"cuda:{dist.detect().local_rank}"
    group = dist.init_process_group("mpi" if device == "cpu" else "nccl")
    for config, chunks in CONFIGS.items():
        got = train(group, chunks, device)
        if group.rank == 0:
            with open(f"{out}.{config}.json", "w") as f:
                json.dump({"world": group.size, "steps": got["steps"]}, f)
            np.savez(f"{out}.{config}.npz", **{f"grad/{n}": g for n, g in got["grads"].items()},
                     **{f"param/{n}": p for n, p in got["params"].items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
