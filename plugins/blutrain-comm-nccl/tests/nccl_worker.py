"""Run by test_nccl_group.py under ``blutrain run``: each NCCL collective on CUDA tensors against NumPy."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt

group = dist.init_process_group("nccl")
rank, size = group.rank, group.size
dev = f"cuda:{group.device}"  # type: ignore[attr-defined]
results: dict[str, Any] = {}


def data(r: int, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    return (np.random.default_rng(100 + r).standard_normal(shape) * 10).astype(np.float32)


def check(name: str, got: bt.Tensor, want: np.ndarray[Any, Any], tol: float = 0.0) -> None:
    g = np.asarray(got.cpu().numpy(), dtype=np.float64)
    err = float(np.abs(g - want).max()) if g.shape == want.shape else float("inf")
    results[name] = {"ok": err <= tol, "err": err}


everyone = [data(r, (5, 3)) for r in range(size)]
stack = np.stack([e.astype(np.float64) for e in everyone])
for op, ref in (("sum", np.sum), ("avg", np.mean), ("max", np.max)):
    t = bt.tensor(everyone[rank], device=dev)
    group.all_reduce(t, op=op)  # type: ignore[arg-type]
    check(f"all_reduce_{op}", t, ref(stack, axis=0), 1e-4)
inputs = [data(r, (size * 2, 3)) for r in range(size)]
out = bt.empty(2, 3, device=dev)
group.reduce_scatter(out, bt.tensor(inputs[rank], device=dev))
check("reduce_scatter", out, sum(i.astype(np.float64) for i in inputs)[rank * 2:(rank + 1) * 2], 1e-4)
out = bt.empty(size * 5, 3, device=dev)
group.all_gather_into_tensor(out, bt.tensor(everyone[rank], device=dev))
check("all_gather_into_tensor", out, np.concatenate(everyone))
outs = [bt.empty(5, 3, device=dev) for _ in range(size)]
work = group.all_gather(outs, bt.tensor(everyone[rank], device=dev), async_op=True)
assert work is not None
work.wait()
check("all_gather_list_async", bt.stack(outs), np.stack(everyone))
t = bt.tensor(everyone[rank], device=dev)
group.broadcast(t, src=size - 1)
check("broadcast", t, everyone[size - 1])
a2a = [data(r, (size * 2, 4)) for r in range(size)]
out = bt.empty(size * 2, 4, device=dev)
group.all_to_all(out, bt.tensor(a2a[rank], device=dev))
check("all_to_all", out, np.concatenate([a2a[s][rank * 2:(rank + 1) * 2] for s in range(size)]))
got = bt.empty(6, device=dev)
if size > 1:
    recv = group.recv(got, src=(rank - 1) % size, async_op=True) if rank % 2 else None
    group.send(bt.tensor(data(rank, (6,)), device=dev), dst=(rank + 1) % size)
    if recv is None:
        group.recv(got, src=(rank - 1) % size)
    else:
        recv.wait()
    check("send_recv_ring", got, data((rank - 1) % size, (6,)))
else:
    results["send_recv_ring"] = {"ok": True, "err": 0.0}
# every rank posts its pair at once: the send and the recv must be one NCCL group, or the ring deadlocks
got = bt.zeros(6, device=dev)
dist.sendrecv(group, bt.tensor(data(rank, (6,)), device=dev), (rank + 1) % size, got, (rank - 1) % size)
check("sendrecv_ring", got, data((rank - 1) % size, (6,)))
parts = [bt.tensor(data(rank, shape), device=dev) for shape in ((7,), (3, 4), (2, 2, 2))]
work = dist.all_reduce_coalesced(group, parts, op="avg", async_op=True)
assert work is not None
work.wait()
for i, (part, shape) in enumerate(zip(parts, ((7,), (3, 4), (2, 2, 2)), strict=True)):
    check(f"all_reduce_coalesced_{i}", part, np.mean([data(r, shape).astype(np.float64) for r in range(size)], axis=0),
          1e-4)
group.barrier()
with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
