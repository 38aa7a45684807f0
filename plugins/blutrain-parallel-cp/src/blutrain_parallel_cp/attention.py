"""Causal attention over a sequence sharded in the load-balanced layout, three ways.

Every function takes this rank's ``q``, ``k``, ``v`` (B, H, T_local, D) in :class:`ChunkLayout` order
and returns its attention output in the same layout, equal to full causal attention restricted to
this rank's queries. Each is built from differentiable ops (tensor ops and the collectives of
:mod:`blutrain_parallel_cp.comm`), so backward is autograd's: correct by construction, and the
collectives run in reverse with the gradients.

- ``ring``: K/V travel round the ring peer to peer (``world - 1`` shifts, each started before the
  current block is computed, so the transfer overlaps the compute). Each (query chunk, key chunk)
  pair is attended on its own: skipped when the key chunk is later (fully masked), causal on the
  diagonal, full when earlier. Partial results carry their per-query log-sum-exp and are merged by
  :func:`merge_partials` (online softmax): never a row of probabilities over the whole sequence.
- ``allgather``: K/V of every rank gathered at once (memory O(T) per rank), then the same chunk pairs.
- ``ulysses``: all-to-all from sequence-sharded to head-sharded (each rank: H / world heads over the
  whole sequence), plain causal attention, all-to-all back. Needs H divisible by world.
"""

from __future__ import annotations

from typing import Literal

from blutrain.dist import DistArgumentError, ProcessGroup
from blutrain.tensor import Tensor, arange, cat, scaled_dot_product_attention, stack
from blutrain_parallel_cp.comm import all_gather, all_to_all, start_ring_shift
from blutrain_parallel_cp.layout import ChunkLayout

AttentionKind = Literal["ring", "allgather", "ulysses"]
ATTENTION_KINDS: tuple[str, ...] = ("ring", "allgather", "ulysses")

Partial = tuple[Tensor, Tensor]  # (output (..., L, D), log-sum-exp (..., L, 1))


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Partial:
    """Softmax attention of ``q`` over ``k``/``v`` and each query's log-sum-exp of scores.

    ``causal``: query i sees keys 0..i (q and k of one chunk). Every query sees at least one key,
    so the log-sum-exp is finite and the masked scores (-inf) get weight exactly zero.
    """
    s = q.matmul(k.transpose(-2, -1)) * scale
    if causal:
        n = s.shape[-1]
        i = arange(n, dtype="int64", device=s.device)
        above = i.reshape(n, 1) < i.reshape(1, n)  # key after query
        s = s.masked_fill(above, float("-inf"))
    lse = s.logsumexp(-1, keepdim=True)
    return (s - lse).exp().matmul(v), lse


def merge_partials(parts: list[Partial]) -> Partial:
    """The attention over the union of the partials' keys: ``lse = log Σ exp(lse_i)`` and
    ``out = Σ exp(lse_i - lse) · out_i`` (each partial re-weighted by its share of the softmax mass)."""
    if not parts:
        raise DistArgumentError("merge_partials: parts must hold at least one (output, lse) pair, got none")
    if len(parts) == 1:
        return parts[0]
    lse = stack([p[1] for p in parts]).logsumexp(0)
    out = parts[0][0] * (parts[0][1] - lse).exp()
    for o, l in parts[1:]:
        out = out + o * (l - lse).exp()
    return out, lse


def _chunk_pairs(q: Tensor, k: Tensor, v: Tensor, q_ids: tuple[int, int], kv_ids: tuple[int, int],
                 parts: list[list[Partial]], scale: float) -> None:
    """Append to ``parts[i]`` the partial of query chunk i over each key chunk it may see."""
    n = q.shape[-2] // 2
    for i, a in enumerate(q_ids):
        qa = q.narrow(-2, i * n, n)
        for j, b in enumerate(kv_ids):
            if b <= a:
                parts[i].append(attend(qa, k.narrow(-2, j * n, n), v.narrow(-2, j * n, n), b == a, scale))


def _finish(parts: list[list[Partial]]) -> Tensor:
    return cat([merge_partials(p)[0] for p in parts], dim=-2)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                   scale: float) -> Tensor:
    r, n = group.rank, group.size
    parts: list[list[Partial]] = [[], []]
    kv = stack([k, v])
    for step in range(n):
        transfer = start_ring_shift(kv, group) if step < n - 1 else None
        src = (r - step) % n
        _chunk_pairs(q, kv[0], kv[1], layout.chunks(r), layout.chunks(src), parts, scale)
        if transfer is not None:
            kv = transfer.finish()
    return _finish(parts)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                        scale: float) -> Tensor:
    kv = all_gather(stack([k, v]), group)  # (world, 2, B, H, T_local, D)
    parts: list[list[Partial]] = [[], []]
    for src in range(group.size):
        _chunk_pairs(q, kv[src, 0], kv[src, 1], layout.chunks(group.rank), layout.chunks(src), parts, scale)
    return _finish(parts)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                      scale: float) -> Tensor:
    W = group.size
    B, H, T_l, D = q.shape
    if H % W:
        raise DistArgumentError(f"ulysses attention: the number of heads ({H}) must be divisible by the "
                                f"context-parallel size {W}; use attn='ring' or 'allgather'")
    h = H // W
    # (3, B, W, h, T_l, D) → (W, 3, B, h, T_l, D): block s holds the heads rank s will compute
    qkv = stack([q, k, v]).reshape(3, B, W, h, T_l, D).permute(2, 0, 1, 3, 4, 5)
    got = all_to_all(qkv, group)  # block s: rank s's positions of my heads
    full = got.permute(1, 2, 3, 0, 4, 5).reshape(3, B, h, W * T_l, D)  # every rank's local sequence in turn
    full = layout.to_natural(full, 3)
    y = scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True, scale=scale)  # (B, h, T, D)
    y = layout.from_natural(y, 2).reshape(B, h, W, T_l, D).permute(2, 0, 1, 3, 4)  # (W, B, h, T_l, D)
    mine = all_to_all(y, group)  # block s: my positions of rank s's heads
    return mine.permute(1, 0, 2, 3, 4).reshape(B, H, T_l, D)


ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                               kind: str = "ring", scale: float | None = None) -> Tensor:
    """Causal attention of this rank's queries (B, H, T_local, D) over the whole sharded sequence."""
    fn = ATTENTION.get(kind)
    if fn is None:
        raise DistArgumentError(f"context_parallel_attention: kind must be one of {', '.join(ATTENTION_KINDS)}, "
                                f"got {kind!r}")
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape or q.shape[2] * group.size != layout.seq_len:
        raise DistArgumentError(f"context_parallel_attention: q, k and v must be (B, H, T_local, D) with T_local · "
                                f"cp = {layout.seq_len}, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)} on "
                                f"{group.size} rank(s)")
    sc = float(scale) if scale is not None else q.shape[-1] ** -0.5
    return fn(q, k, v, group, layout, sc)


__all__ = ["ATTENTION_KINDS", "AttentionKind", "Partial", "allgather_attention", "attend",
           "context_parallel_attention", "merge_partials", "ring_attention", "ulysses_attention"]
