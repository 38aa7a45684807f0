"""Every collective of the "mpi" group on this world, each checked against a NumPy reference.

Every rank can compute every rank's input (seeded by rank), so each writes, per check, whether its
result equals the reference; rank r writes OUT.r.json. A failed check records the largest error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt

out_prefix = sys.argv[1]
group = dist.init_process_group("mpi")
rank, size = group.rank, group.size
results: dict[str, Any] = {}


def data(r: int, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray[Any, Any]:
    a = np.random.default_rng(100 + r).standard_normal(shape) * 10
    return a.astype(bt.as_dtype(dtype).np)


def check(name: str, got: Any, want: Any, tol: float = 0.0) -> None:
    g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    err = float(np.abs(g - w).max()) if g.shape == w.shape and g.size else (0.0 if g.shape == w.shape else np.inf)
    results[name] = {"ok": bool(g.shape == w.shape and err <= tol), "err": err, "shape": list(g.shape)}


def run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # recorded, so that one broken collective does not hide the others
        results[name] = {"ok": False, "err": f"{type(exc).__name__}: {exc}"}


everyone = [data(r, (5, 3)) for r in range(size)]


def all_reduce() -> None:
    for op, ref in (("sum", np.sum), ("avg", np.mean), ("max", np.max), ("min", np.min)):
        t = bt.tensor(everyone[rank])
        group.all_reduce(t, op=op)  # type: ignore[arg-type]
        want = ref(np.stack([e.astype(np.float64) for e in everyone]), axis=0)
        check(f"all_reduce_{op}", t.numpy(), want, 1e-5 * size * 10)
    for dtype, tol in (("float64", 1e-12), ("int64", 0.0), ("bfloat16", 0.25)):
        t = bt.tensor(data(rank, (7,), dtype))
        group.all_reduce(t)
        check(f"all_reduce_sum_{dtype}", t.numpy(), sum(data(r, (7,), dtype).astype(np.float64) for r in range(size)),
              tol)
    # a strided view is reduced in place too
    base = bt.tensor(data(rank, (4, 6)))
    group.all_reduce(base[:, ::2])
    want = data(rank, (4, 6)).astype(np.float64)
    want[:, ::2] = sum(data(r, (4, 6))[:, ::2].astype(np.float64) for r in range(size))
    check("all_reduce_strided_view", base.numpy(), want, 1e-4)


def reduce_scatter() -> None:
    inputs = [data(r, (size * 2, 3)) for r in range(size)]
    out = bt.empty(2, 3)
    group.reduce_scatter(out, bt.tensor(inputs[rank]))
    total = sum(i.astype(np.float64) for i in inputs)
    check("reduce_scatter_sum", out.numpy(), total[rank * 2:(rank + 1) * 2], 1e-4)


def all_gather() -> None:
    out = bt.empty(size * 5, 3)
    group.all_gather_into_tensor(out, bt.tensor(everyone[rank]))
    check("all_gather_into_tensor", out.numpy(), np.concatenate(everyone))
    outs = [bt.empty(5, 3) for _ in range(size)]
    group.all_gather(outs, bt.tensor(everyone[rank]))
    check("all_gather_list", np.stack([o.numpy() for o in outs]), np.stack(everyone))


def broadcast() -> None:
    src = size - 1
    t = bt.tensor(data(rank, (3, 2), "bfloat16"))
    group.broadcast(t, src=src)
    check("broadcast_bfloat16", t.numpy(), data(src, (3, 2), "bfloat16"))


def all_to_all() -> None:
    inputs = [data(r, (size * 2, 4)) for r in range(size)]
    out = bt.empty(size * 2, 4)
    group.all_to_all(out, bt.tensor(inputs[rank]))
    check("all_to_all", out.numpy(), np.concatenate([inputs[s][rank * 2:(rank + 1) * 2] for s in range(size)]))


def send_recv() -> None:
    # a ring: send to the next rank, receive from the previous one (non-blocking both, so no deadlock)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    got = bt.empty(6)
    work = group.recv(got, src=prv, async_op=True)
    group.send(bt.tensor(data(rank, (6,))), dst=nxt)
    assert work is not None
    work.wait()
    check("send_recv_ring", got.numpy(), data(prv, (6,)))


def async_ops() -> None:
    ts = [bt.tensor(data(rank, (8,)) + i) for i in range(3)]
    works = [group.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        assert w is not None
        w.wait()
    want = [sum(data(r, (8,)).astype(np.float64) + i for r in range(size)) for i in range(3)]
    check("all_reduce_async_three_in_flight", np.stack([t.numpy() for t in ts]), np.stack(want), 1e-4)


def coalesced() -> None:
    shapes = ((7,), (3, 4), (2, 2, 2))
    parts = [bt.tensor(data(rank, shape)) for shape in shapes]
    work = dist.all_reduce_coalesced(group, parts, op="avg", async_op=True)
    assert work is not None
    work.wait()
    want = [np.mean([data(r, shape).astype(np.float64) for r in range(size)], axis=0) for shape in shapes]
    check("all_reduce_coalesced_avg", np.concatenate([p.numpy().ravel() for p in parts]),
          np.concatenate([w.ravel() for w in want]), 1e-5)


def barrier_and_mesh() -> None:
    group.barrier()
    results["barrier"] = {"ok": True, "err": 0.0}
    if size % 2:
        results["mesh_groups"] = {"ok": True, "err": "odd world: no 2-D mesh"}
        return
    mesh = dist.DeviceMesh(group, {"dp": size // 2, "tp": 2})
    ok = True
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        t = bt.tensor([float(rank)])
        g.all_reduce(t)
        ok &= bool(t.numpy()[0] == sum(mesh.ranks(dim))) and g.rank == mesh.local_rank(dim)
    results["mesh_groups"] = {"ok": ok, "err": 0.0}


for name, fn in (("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter), ("all_gather", all_gather),
                 ("broadcast", broadcast), ("all_to_all", all_to_all), ("send_recv", send_recv),
                 ("async", async_ops), ("coalesced", coalesced), ("barrier_mesh", barrier_and_mesh)):
    run(name, fn)
with open(f"{out_prefix}.{rank}.json", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
