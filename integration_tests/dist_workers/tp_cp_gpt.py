"""Tensor and context parallelism on whatever world this process is in, against float64 references and
the single-process run.

Under ``blutrain run -n N`` each rank runs, in order, the unit checks (``units``: the vocab-parallel
cross-entropy and the three context-parallel attentions in float64 and float32, forward and backward, against
NumPy float64)
and a few AdamW steps of a tiny GPT-2 under each configuration named by ``--configs``:
``tp`` (tp = N), ``tp-async`` (tp = N, async TP in ``ASYNC_CHUNKS`` row blocks), ``cp-ring`` /
``cp-allgather`` / ``cp-ulysses`` (cp = N), ``dp-tp``, ``dp-tp-async`` and ``dp-cp-<attn>`` (dp = 2 × the
rest). The unit checks also run async TP's fused Linears against float64, with one block, with uneven
blocks and with more blocks than rows. Ranks start from different random weights, so matching results also prove the
initial broadcasts. Every rank writes ``OUT.<rank>.json`` (unit results, per-step global losses);
rank 0 writes ``OUT.<config>.npz`` with the final parameters, gathered to their single-process shapes.

``train(None, ...)`` is the single-process reference (the test imports this file and calls it).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config
from blutrain.optim import create

CONFIG = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}
STEPS, BATCH = 3, 4
ASYNC_CHUNKS = 3  # uneven blocks of the 64 (tp) or 32 (dp × tp) rows of a step


def tiny_gpt(seed: int) -> GPT2:
    bt.manual_seed(seed)
    return GPT2(GPT2Config.preset("tiny", **CONFIG))


def batch(step: int, vocab: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(step).integers(0, vocab, (BATCH, CONFIG["block_size"] + 1))


def train(config: str | None, group: Any = None) -> tuple[list[float], dict[str, np.ndarray[Any, Any]]]:
    """Losses per step and final full parameters; ``config`` None: one process, plain GPT2."""
    rank = group.rank if group is not None else 0
    model = tiny_gpt(1234 + rank)
    dp_group, dp_rank, dp_size = None, 0, 1
    wrapped: Any = model
    full: Any = None
    if config is not None:
        from blutrain_parallel_cp import CP
        from blutrain_parallel_ddp import DDP
        from blutrain_parallel_tp import TP

        world = group.size
        kind, _, attn = config.partition("-")
        with_dp = kind == "dp"
        if with_dp:
            kind, _, attn = attn.partition("-")
        if kind == "tpcp":  # context parallelism over a tensor-parallel model: cp × tp
            mesh = dist.DeviceMesh(group, {"cp": 2, "tp": world // 2})
            tp_model = TP(mesh).wrap_model(model)
            wrapped, full = CP(mesh, attn=attn).wrap_model(tp_model), tp_model.full_parameters
        else:
            mesh = dist.DeviceMesh(group, {"dp": 2, kind: world // 2} if with_dp else {kind: world})
            if kind == "tp":
                tp_model = TP(mesh, async_chunks=ASYNC_CHUNKS if attn == "async" else 0).wrap_model(model)
                wrapped, full = tp_model, tp_model.full_parameters
            else:
                wrapped = CP(mesh, attn=attn).wrap_model(model)
        if with_dp:
            wrapped = DDP(mesh, bucket_cap_mb=0.02).wrap_model(wrapped)
            dp_group, dp_rank, dp_size = mesh.get_group("dp"), mesh.local_rank("dp"), 2
    optimizer = create("adamw", list(wrapped.parameters()), lr=3e-3, weight_decay=0.1)
    per_rank = BATCH // dp_size
    losses = []
    for step in range(STEPS):
        tokens = batch(step, model.config.vocab_size)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        x = bt.tensor(tokens[:, :-1].astype(np.int64))
        y = bt.tensor(tokens[:, 1:].astype(np.int64))
        _, loss = wrapped(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = bt.tensor([float(loss.item())], dtype="float64")
        if dp_group is not None:
            dp_group.all_reduce(mean, op="avg")
        losses.append(float(mean.numpy()[0]))
    params = full() if full is not None else {n: p.detach() for n, p in model.named_parameters()}
    return losses, {n: p.numpy() for n, p in params.items()}


# ------------------------------------------------------------------------------------ unit checks


def _close(got: Any, want: Any, tol: float) -> dict[str, Any]:
    err = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)))
    return {"ok": bool(err < tol), "err": err}


def check_vocab_parallel_cross_entropy(group: Any, dtype: str, tol: float) -> dict[str, Any]:
    from blutrain_parallel_tp import vocab_parallel_cross_entropy

    W, r = group.size, group.rank
    N, V = 7, 6 * W
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((N, V)) * 3
    target = rng.integers(0, V, N)
    target[2] = -1  # ignored
    valid = target != -1
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    want_loss = (lse - logits[np.arange(N), np.where(valid, target, 0)])[valid].mean()
    probs = np.exp(logits - lse[:, None])
    onehot = np.zeros_like(probs)
    onehot[np.arange(N)[valid], target[valid]] = 1
    want_grad = (probs - onehot) * valid[:, None] / valid.sum() * 2.0  # d(2·loss)
    cols = slice(r * 6, (r + 1) * 6)
    mine = bt.tensor(logits[:, cols], dtype=dtype, requires_grad=True)
    loss = vocab_parallel_cross_entropy(mine, bt.tensor(target.astype(np.int64)), group, r * 6, ignore_index=-1)
    (loss * 2.0).backward()
    assert mine.grad is not None
    a, b = _close(loss.item(), want_loss, tol), _close(mine.grad.numpy(), want_grad[:, cols], tol)
    return {"ok": a["ok"] and b["ok"], "err": max(a["err"], b["err"])}


def _reference_attention(q: Any, k: Any, v: Any, w: Any) -> tuple[Any, ...]:
    """Causal attention in float64 and the gradients of sum(out · w) with respect to q, k, v."""
    T, D = q.shape[-2], q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    dv = np.swapaxes(p, -1, -2) @ w
    dp = w @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(D)
    return out, ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


def check_context_parallel_attention(group: Any, kind: str, dtype: str, tol: float) -> dict[str, Any]:
    from blutrain_parallel_cp import ChunkLayout, context_parallel_attention

    W, r = group.size, group.rank
    B, H, T, D = 2, 4, 4 * W, 8
    rng = np.random.default_rng(7)
    q, k, v, w = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    out, dq, dk, dv = _reference_attention(q, k, v, w)
    layout = ChunkLayout(T, W)
    pos = layout.positions(r)
    mine = [bt.tensor(a[:, :, pos], dtype=dtype, requires_grad=True) for a in (q, k, v)]
    got = context_parallel_attention(*mine, group, layout, kind)
    (got * bt.tensor(w[:, :, pos], dtype=dtype)).sum().backward()
    errs = [_close(got.detach().numpy(), out[:, :, pos], tol)]
    errs += [_close(t.grad.numpy(), ref[:, :, pos], tol) for t, ref in zip(mine, (dq, dk, dv), strict=True)
             if t.grad is not None]
    return {"ok": len(errs) == 4 and all(e["ok"] for e in errs), "err": max(e["err"] for e in errs)}


def check_async_linear(group: Any, kind: str, chunks: int, tol: float) -> dict[str, Any]:
    """Async TP's fused ``kind`` ("row" / "column") Linear in ``chunks`` row blocks, forward and the
    gradients of sum(out · w), against float64 on the full tensors (2 × 5 = 10 rows)."""
    from blutrain_parallel_tp import column_parallel_linear, row_parallel_linear

    W, r = group.size, group.rank
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 5, 3 * W if kind == "row" else 4))
    weight = rng.standard_normal((6, 3 * W) if kind == "row" else (3 * W, 4))
    bias = rng.standard_normal(3 * W)
    own = slice(r * 3, (r + 1) * 3)
    if kind == "row":
        out = x @ weight.T
        w = rng.standard_normal(out.shape)
        want = {"out": out, "x": (w @ weight)[..., own], "weight": (w.reshape(-1, 6).T @ x.reshape(-1, 3 * W))[:, own]}
        xs = bt.tensor(x[..., own], dtype="float64", requires_grad=True)
        ws = bt.tensor(weight[:, own], dtype="float64", requires_grad=True)
        got = row_parallel_linear(xs, ws, group, chunks)
        (got * bt.tensor(w, dtype="float64")).sum().backward()
        grads = {"x": xs.grad, "weight": ws.grad}
    else:
        out = x @ weight.T + bias
        w = rng.standard_normal(out.shape)
        want = {"out": out[..., own], "x": w @ weight,
                "weight": (w.reshape(-1, 3 * W).T @ x.reshape(-1, 4))[own], "bias": w.reshape(-1, 3 * W).sum(0)[own]}
        xs = bt.tensor(x, dtype="float64", requires_grad=True)
        ws = bt.tensor(weight[own], dtype="float64", requires_grad=True)
        bs = bt.tensor(bias[own], dtype="float64", requires_grad=True)
        got = column_parallel_linear(xs, ws, bs, group, chunks)
        (got * bt.tensor(w[..., own], dtype="float64")).sum().backward()
        grads = {"x": xs.grad, "weight": ws.grad, "bias": bs.grad}
    errs = [_close(got.detach().numpy(), want["out"], tol)]
    errs += [_close(g.numpy(), want[k], tol) for k, g in grads.items() if g is not None]
    return {"ok": len(errs) == len(want) and all(e["ok"] for e in errs), "err": max(e["err"] for e in errs)}


def units(group: Any) -> dict[str, Any]:
    out = {"vocab_parallel_cross_entropy_float64": check_vocab_parallel_cross_entropy(group, "float64", 1e-12),
           "vocab_parallel_cross_entropy_float32": check_vocab_parallel_cross_entropy(group, "float32", 1e-6)}
    for kind in ("ring", "allgather", "ulysses"):
        for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
            out[f"attention_{kind}_{dtype}"] = check_context_parallel_attention(group, kind, dtype, tol)
    for kind in ("row", "column"):
        for chunks in (1, 3, 16):  # one block; blocks of 4, 3 and 3 rows; more blocks than the 10 rows
            out[f"async_{kind}_linear_{chunks}_chunks_float64"] = check_async_linear(group, kind, chunks, 1e-12)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="*", default=[])
    parser.add_argument("--units", action="store_true")
    args = parser.parse_args()
    group = dist.init_process_group("mpi")
    result: dict[str, Any] = {"world": group.size, "units": units(group) if args.units else {}, "losses": {}}
    for config in args.configs:
        losses, params = train(config, group)
        result["losses"][config] = losses
        if group.rank == 0:
            np.savez(f"{args.out}.{config}.npz", **params)
    with open(f"{args.out}.{group.rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
