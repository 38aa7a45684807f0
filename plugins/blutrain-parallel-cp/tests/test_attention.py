"""Ring and all-gather attention against float64 causal attention, forward and the gradients of q, k
and v, on 1 to 4 ranks simulated by threads of this process (``ThreadRanks``: the sendrecv, all-gather
and reduce-scatter the attentions use, over queues and a barrier); the flash-attention building blocks
(``attend``, ``merge_partials``) against float64. The same attentions over MPI ranks:
integration_tests/test_dist_tp_cp.py."""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError
from blutrain_parallel_cp import ChunkLayout, attend, context_parallel_attention, merge_partials
from blutrain_parallel_cp.attention import ALLGATHER_ATTENTION, RING_ATTENTION

Array = np.ndarray[Any, Any]
TIMEOUT = 30.0


class Done:
    def __init__(self, fn: Any = None) -> None:
        self.fn = fn

    def wait(self) -> None:
        if self.fn is not None:
            self.fn()

    def is_completed(self) -> bool:
        return True


class ThreadRanks:
    """``size`` ranks, one thread each: what rank r's attention sees as its process group is ``rank(r)``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)
        self.slots: list[Array | None] = [None] * size
        self.boxes = {(s, d): queue.Queue[Array]() for s in range(size) for d in range(size)}

    def rank(self, r: int) -> ThreadRank:
        return ThreadRank(self, r)


class ThreadRank:
    backend = "threads"

    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        self.ranks, self.rank, self.size = ranks, rank, ranks.size

    def sendrecv(self, send: bt.Tensor, dst: int, recv: bt.Tensor, src: int, async_op: bool = False) -> Done | None:
        self.ranks.boxes[self.rank, dst].put(send.numpy().copy())

        def finish() -> None:
            recv.copy_(bt.tensor(self.ranks.boxes[src, self.rank].get(timeout=TIMEOUT), dtype=recv.dtype))

        if async_op:
            return Done(finish)
        finish()
        return None

    def _everyone(self, x: bt.Tensor) -> list[Array]:
        self.ranks.slots[self.rank] = x.numpy().copy()
        self.ranks.barrier.wait()
        got = [a for a in self.ranks.slots if a is not None]
        self.ranks.barrier.wait()  # every rank has read the slots before any writes them again
        return got

    def all_gather_into_tensor(self, output: bt.Tensor, input: bt.Tensor) -> None:
        output.copy_(bt.tensor(np.concatenate(self._everyone(input)), dtype=output.dtype))

    def reduce_scatter(self, output: bt.Tensor, input: bt.Tensor, op: str = "sum") -> None:
        assert op == "sum"
        m = output.shape[0]
        mine = sum(a[self.rank * m:(self.rank + 1) * m] for a in self._everyone(input))
        output.copy_(bt.tensor(mine, dtype=output.dtype))


@pytest.fixture(scope="module", autouse=True)
def _plugins_loaded_before_any_thread() -> None:
    """The plugins load on the first op; one thread must do that, not every rank's at once."""
    for dtype in ("float32", "float64"):
        x = bt.ones(1, 1, 2, 1, dtype=dtype, requires_grad=True)
        for kind in ("ring", "allgather"):
            context_parallel_attention(x, x, x, ThreadRanks(1).rank(0), ChunkLayout(2, 1), kind).sum().backward()  # type: ignore[arg-type]
        merge_partials([(x, x.detach().sum(-1)), (x, x.detach().sum(-1))])


def causal_attention(q: Array, k: Array, v: Array, w: Array) -> tuple[Array, ...]:
    """Causal attention in float64 and the gradients of sum(out · w) with respect to q, k, v. k and v may
    have fewer heads than q (grouped-query attention): repeated here, their gradients summed back."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        out, dq, dk, dv = causal_attention(q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), w)
        B, H_kv, T, D = k.shape
        return out, dq, dk.reshape(B, H_kv, group, T, D).sum(2), dv.reshape(B, H_kv, group, T, D).sum(2)
    T, D = q.shape[-2], q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = w @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(D)
    return p @ v, ds @ k, np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ w


def on_ranks(world: int, kind: str, dtype: str, q: Array, k: Array, v: Array, w: Array) -> list[tuple[Any, ...]]:
    """Each rank's attention output and q, k, v gradients (of sum(out · w)), its positions' rows."""
    layout = ChunkLayout(q.shape[-2], world)
    ranks = ThreadRanks(world)
    results: list[Any] = [None] * world

    def run(r: int) -> None:
        try:
            pos = layout.positions(r)
            mine = [bt.tensor(a[:, :, pos], dtype=dtype, requires_grad=True) for a in (q, k, v)]
            tq, tk, tv = mine
            y = context_parallel_attention(tq, tk, tv, ranks.rank(r), layout, kind)  # type: ignore[arg-type]
            (y * bt.tensor(w[:, :, pos], dtype=dtype)).sum().backward()
            results[r] = (y.detach().numpy(), *(t.grad.numpy() for t in mine if t.grad is not None))
        except BaseException as exc:
            results[r] = exc
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for found in results:
        if isinstance(found, BaseException):
            raise found
    return results


@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-12), ("float32", 2e-5)])
@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), kind=st.sampled_from(["ring", "allgather"]), batch=st.integers(1, 2),
       heads=st.integers(1, 3), group=st.sampled_from((1, 1, 2, 3)), chunk=st.integers(1, 4),
       head_dim=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_ring_and_allgather_equal_causal_attention_forward_and_backward(
        dtype: str, tol: float, world: int, kind: str, batch: int, heads: int, group: int, chunk: int,
        head_dim: int, seed: int) -> None:
    """``heads`` K/V heads, each shared by ``group`` query heads (grouped-query attention when > 1)."""
    T = 2 * world * chunk
    rng = np.random.default_rng(seed)
    q, w = (rng.standard_normal((batch, heads * group, T, head_dim)) for _ in range(2))
    k, v = (rng.standard_normal((batch, heads, T, head_dim)) for _ in range(2))
    want = causal_attention(q, k, v, w)
    layout = ChunkLayout(T, world)
    for r, got in enumerate(on_ranks(world, kind, dtype, q, k, v, w)):
        assert len(got) == 4
        for name, a, ref in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_allclose(a, ref[:, :, layout.positions(r)], rtol=0, atol=tol,
                                       err_msg=f"{kind} on {world} ranks, rank {r}: {name}")


@pytest.mark.parametrize(("kind", "op"), [("ring", RING_ATTENTION), ("allgather", ALLGATHER_ATTENTION)])
def test_ring_and_allgather_are_one_autograd_op_keeping_no_score_matrix(kind: str, op: str) -> None:
    q, k, v = (bt.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    y = context_parallel_attention(q, k, v, ThreadRanks(1).rank(0), ChunkLayout(8, 1), kind)  # type: ignore[arg-type]
    assert y.grad_fn is not None and y.grad_fn.op == op
    saved = [t for t in y.grad_fn.saved if isinstance(t, bt.Tensor)]
    # q, k, v, the output and the float32 log-sum-exp; nothing of size T²
    assert [list(t.shape) for t in saved] == [[1, 2, 8, 4]] * 4 + [[1, 2, 8]]
    assert saved[-1].dtype is bt.float32


def test_attend_gives_the_output_and_log_sum_exp_of_causal_attention_in_float64() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 6, 3)) for _ in range(3))
    tq, tk, tv = (bt.tensor(a, dtype="float64") for a in (q, k, v))
    out, lse = attend(tq, tk, tv, True, 0.5)
    s = np.where(np.tril(np.ones((6, 6), bool)), q @ np.swapaxes(k, -1, -2) * 0.5, -np.inf)
    want_lse = np.log(np.exp(s).sum(-1))
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-14)
    np.testing.assert_allclose(out.numpy(), np.exp(s - want_lse[..., None]) @ v, atol=1e-14)


def test_merging_partials_over_key_blocks_equals_attention_over_all_keys_in_float64() -> None:
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((9, 4)) * 3, rng.standard_normal((9, 4))
    tq, tk, tv = (bt.tensor(a, dtype="float64") for a in (q, k, v))
    out, lse = merge_partials([attend(tq, tk[a:b], tv[a:b], False, 0.5) for a, b in [(0, 2), (2, 7), (7, 9)]])
    s = q @ k.T * 0.5
    want_lse = np.log(np.exp(s).sum(-1))
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-14)
    np.testing.assert_allclose(out.numpy(), np.exp(s - want_lse[:, None]) @ v, atol=1e-14)


def test_partials_merge_in_float32_whatever_their_dtype() -> None:
    parts = [(bt.ones(3, 2, dtype="bfloat16"), bt.zeros(3, dtype="bfloat16")) for _ in range(2)]
    out, lse = merge_partials(parts)
    assert out.dtype is bt.float32 and lse.dtype is bt.float32
    np.testing.assert_allclose(lse.numpy(), np.log(2.0), rtol=1e-7)
    np.testing.assert_allclose(out.numpy(), 1.0, rtol=1e-7)


def test_merging_nothing_is_an_error() -> None:
    with pytest.raises(DistArgumentError, match="at least one"):
        merge_partials([])


def test_grouped_key_value_heads_travel_as_they_are_and_get_gradients_of_their_shape() -> None:
    q = bt.randn(1, 4, 8, 4, requires_grad=True)
    k, v = (bt.randn(1, 2, 8, 4, requires_grad=True) for _ in range(2))
    y = context_parallel_attention(q, k, v, ThreadRanks(1).rank(0), ChunkLayout(8, 1), "ring")  # type: ignore[arg-type]
    saved = [list(t.shape) for t in y.grad_fn.saved if isinstance(t, bt.Tensor)]  # type: ignore[union-attr]
    assert saved[1:3] == [[1, 2, 8, 4]] * 2  # k and v kept with their 2 heads, not repeated to 4
    y.sum().backward()
    assert y.shape == (1, 4, 8, 4) and k.grad is not None and k.grad.shape == (1, 2, 8, 4)


def test_key_value_heads_that_do_not_divide_the_query_heads_are_an_error() -> None:
    q, k = bt.zeros(1, 3, 8, 4), bt.zeros(1, 2, 8, 4)
    with pytest.raises(DistArgumentError, match="H a multiple of H_kv"):
        context_parallel_attention(q, k, k, ThreadRanks(1).rank(0), ChunkLayout(8, 1), "ring")  # type: ignore[arg-type]


def test_a_shape_that_does_not_fit_the_layout_is_an_error_naming_it() -> None:
    q = bt.zeros(1, 2, 6, 4)
    with pytest.raises(DistArgumentError, match=r"T_local · cp = 8, got \[1, 2, 6, 4\]"):
        context_parallel_attention(q, q, q, ThreadRanks(1).rank(0), ChunkLayout(8, 1), "ring")  # type: ignore[arg-type]
