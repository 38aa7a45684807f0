"""Causal attention over a sequence sharded in the load-balanced layout, three ways.

Every function takes this rank's ``q`` (B, H, T_local, D) and ``k``, ``v`` (B, H_kv, T_local, D) in
:class:`ChunkLayout` order and returns its attention output in the same layout, equal to full causal
attention restricted to this rank's queries. H_kv may be a divisor of H (grouped-query attention: query
head h reads K/V head h // (H / H_kv)); ring and all-gather then move and attend the H_kv shared heads as
they are (the flash-attention kernels take grouped heads), ulysses repeats them to H first.

- ``ring``: K/V travel round the ring peer to peer (``world - 1`` shifts, each started before the
  current block is computed, so the transfer overlaps the compute).
- ``allgather``: K/V of every rank gathered at once (memory O(T) per rank), then the same blocks.
- ``ulysses``: all-to-all from sequence-sharded to head-sharded (each rank: H / world heads over the
  whole sequence), plain causal attention, all-to-all back. Needs H divisible by world. Built from
  differentiable ops (the collectives of :mod:`blutrain_parallel_cp.comm`), so backward is autograd's.

Ring and all-gather never form a score matrix. Rank r holding the K/V of rank s attends one block with
the flash-attention kernel (``sdpa``: the block's output and each query's log-sum-exp): s == r, its
whole local sequence, causal (its early chunk r precedes its late chunk 2W-1-r, so the top-left mask
of the two is the global one); s < r, all its queries over s's early chunk, unmasked (s's late chunk
comes after both of r's); s > r, its late chunk over s's whole local sequence, unmasked (its early
chunk precedes neither of s's). The blocks of a query chunk are merged by online softmax in float32
(float64 for float64 inputs; :func:`merge_partials`). Each attention is one autograd op
(``RING_ATTENTION``, ``ALLGATHER_ATTENTION``) whose backward is exact without a gradient through the
log-sum-exp: every block's ``sdpa_backward`` is given the merged output and log-sum-exp of its queries,
so the probabilities it recomputes, exp(S - lse), are the global softmax restricted to the block and its
rowsum(dO · O) the global one, and the blocks' dq, dk, dv sum to the whole attention's. dq accumulates
on the rank; dk/dv of a block accumulate in float32 and go back to the block's owner: round the ring
with the block (each shift overlapping the next block's compute, plus one shift at the end), or by one
reduce-scatter after a second all-gather. Saved for backward: q, k, v, the output and the float32
log-sum-exp; nothing of size T_local², nor the gathered K/V.
"""

from __future__ import annotations

from typing import Any, Literal

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import no_double_backward
from blutrain.dist import DistArgumentError, ProcessGroup, Work
from blutrain.tensor import Tensor, cat, dispatch, float32, float64, scaled_dot_product_attention, stack, zeros_like
from blutrain.tensor.autocast import lower
from blutrain.tensor.dtype import DType
from blutrain_parallel_cp.comm import (
    all_to_all,
    gather_unrecorded,
    incoming_grad,
    reduce_scatter_unrecorded,
    start_exchange,
)
from blutrain_parallel_cp.layout import ChunkLayout

AttentionKind = Literal["ring", "allgather", "ulysses"]
ATTENTION_KINDS: tuple[str, ...] = ("ring", "allgather", "ulysses")
RING_ATTENTION = "cp_ring_attention"
ALLGATHER_ATTENTION = "cp_allgather_attention"

Partial = tuple[Tensor, Tensor]  # (output (..., L, D), log-sum-exp (..., L))
Block = tuple[int, int, bool]  # (first query row, key rows from the start, causal)


def _wide(dtype: DType) -> DType:
    """The dtype partials merge and gradients accumulate in."""
    return float64 if dtype is float64 else float32


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Partial:
    """The attention of ``q`` (..., L, D) over ``k``/``v`` (..., S, D) and each query's log-sum-exp of
    scores (..., L), by the flash-attention kernel ("sdpa"; ``causal``: query i sees keys 0..i). Values
    only, not recorded: the ring and all-gather ops differentiate their merged result as a whole."""
    out, lse = dispatch.call_multi("sdpa", q, k, v, None, causal, scale, out_dtypes=(q.dtype, None))
    assert out is not None and lse is not None  # the kernel returns both
    return out, lse


def merge_partials(parts: list[Partial]) -> Partial:
    """The attention over the union of the partials' keys, in float32 (float64 for float64 outputs):
    ``lse = log Σ exp(lse_i)`` and ``out = Σ exp(lse_i - lse) · out_i`` (each partial re-weighted by its
    share of the softmax mass)."""
    if not parts:
        raise DistArgumentError("merge_partials: parts must hold at least one (output, lse) pair, got none")
    wide = _wide(parts[0][0].dtype)
    lses = [p[1].to(dtype=wide) for p in parts]
    if len(parts) == 1:
        return parts[0][0].to(dtype=wide), lses[0]
    lse = stack(lses).logsumexp(0)
    out = parts[0][0].to(dtype=wide) * (lses[0] - lse).exp().unsqueeze(-1)
    for (o, _), l in zip(parts[1:], lses[1:], strict=True):
        out = out + o.to(dtype=wide) * (l - lse).exp().unsqueeze(-1)
    return out, lse


def _block(rank: int, src: int, chunk: int) -> Block:
    """The part of the causal mask between ``rank``'s queries and ``src``'s keys (see the module doc)."""
    if src == rank:
        return 0, 2 * chunk, True
    return (0, chunk, False) if src < rank else (chunk, 2 * chunk, False)


def _rows(x: Tensor, start: int) -> Tensor:
    return x.narrow(-2, start, x.shape[-2] - start)


def _merge_block(acc: list[Partial | None], q: Tensor, k: Tensor, v: Tensor, block: Block, scale: float) -> None:
    """Merge the block's partial into the accumulators of the query chunks it covers."""
    q0, keys, causal = block
    out, lse = attend(_rows(q, q0), k.narrow(-2, 0, keys), v.narrow(-2, 0, keys), causal, scale)
    n = q.shape[-2] // 2
    for i in range(q0 // n, 2):
        piece = out.narrow(-2, i * n - q0, n), lse.narrow(-1, i * n - q0, n)
        prev = acc[i]
        acc[i] = piece if prev is None else merge_partials([prev, piece])


def _merged(acc: list[Partial | None], dtype: DType) -> Partial:
    """The whole local sequence's output (in ``dtype``) and float32 log-sum-exp from the chunks' merges."""
    parts = [p for p in acc if p is not None]
    out = cat([p[0] for p in parts], dim=-2)
    lse = cat([p[1] for p in parts], dim=-1)
    return out.to(dtype=dtype), lse.to(dtype=_wide(dtype))


def _block_grads(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: Block,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of dq (its query rows), dk and dv (its key rows), given the merged ``out`` and
    ``lse`` of the queries."""
    q0, keys, causal = block
    dq, dk, dv = dispatch.call_multi(
        "sdpa_backward", _rows(dout, q0), _rows(q, q0), k.narrow(-2, 0, keys), v.narrow(-2, 0, keys), _rows(out, q0),
        lse.narrow(-1, q0, lse.shape[-1] - q0), None, causal, scale, dtype=q.dtype)
    assert dq is not None and dk is not None and dv is not None  # the kernel returns all three
    return dq, dk, dv


def _add_block(dq: Tensor, dkv: Tensor, grads: tuple[Tensor, Tensor, Tensor], block: Block) -> None:
    """Add a block's gradients into the float32 accumulators of the queries (dq) and of its K/V (dkv:
    dk and dv stacked)."""
    q0, keys, _ = block
    _rows(dq, q0).add_(grads[0])
    dkv.select(0, 0).narrow(-2, 0, keys).add_(grads[1])
    dkv.select(0, 1).narrow(-2, 0, keys).add_(grads[2])


def _received(transfer: tuple[Tensor, Work | None]) -> Tensor:
    out, work = transfer
    if work is not None:
        work.wait()
    return out


def _save(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    q, k, v = inputs
    return (q, k, v, outputs[0].detach(), attrs["lse"])


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                   scale: float) -> Tensor:
    """Ring attention (see the module doc): one ``RING_ATTENTION`` op."""
    q, k, v = lower(q), lower(k), lower(v)
    r, n = group.rank, group.size
    with no_grad():
        acc: list[Partial | None] = [None, None]
        kv = stack([k, v])
        for step in range(n):
            # the next shift is in flight while this block is computed
            transfer = start_exchange(kv, group, (r + 1) % n, (r - 1) % n) if step < n - 1 else None
            _merge_block(acc, q, kv[0], kv[1], _block(r, (r - step) % n, layout.chunk), scale)
            if transfer is not None:
                kv = _received(transfer)
        out, lse = _merged(acc, q.dtype)
    record(RING_ATTENTION, (q, k, v), out, {"group": group, "chunk": layout.chunk, "scale": scale, "lse": lse})
    return out


@derivative(RING_ATTENTION, save=_save)
def _ring_attention_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor, Tensor, Tensor]:
    no_double_backward("ring attention", create_graph)
    q, k, v, out, lse = node.saved
    group: ProcessGroup = node.attrs["group"]
    r, n = group.rank, group.size
    dout = incoming_grad(node, grads)
    dq = None
    kv = stack([k, v])
    moving: tuple[Tensor, Work | None] | None = None  # the dk/dv of the K/V block held, on its way round
    for step in range(n):
        transfer = start_exchange(kv, group, (r + 1) % n, (r - 1) % n) if step < n - 1 else None
        block = _block(r, (r - step) % n, node.attrs["chunk"])
        g = _block_grads(dout, q, kv[0], kv[1], out, lse, block, node.attrs["scale"])
        if moving is None:  # step 0: the whole local block, causal, covers every row
            dq, dkv = g[0].to(dtype=lse.dtype), stack([g[1], g[2]]).to(dtype=lse.dtype)
        else:
            assert dq is not None
            dkv = _received(moving)  # sent by the previous rank while this block was computed
            _add_block(dq, dkv, g, block)
        # to the next rank, with the K/V it belongs to; the last shift brings every rank its own
        moving = start_exchange(dkv, group, (r + 1) % n, (r - 1) % n) if n > 1 else (dkv, None)
        if transfer is not None:
            kv = _received(transfer)
    assert dq is not None and moving is not None
    dkv = _received(moving)
    return dq.to(dtype=q.dtype), dkv[0].to(dtype=k.dtype), dkv[1].to(dtype=v.dtype)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                        scale: float) -> Tensor:
    """All-gather attention (see the module doc): one ``ALLGATHER_ATTENTION`` op."""
    q, k, v = lower(q), lower(k), lower(v)
    with no_grad():
        kv = gather_unrecorded(stack([k, v]), group)  # (world, 2, B, H, T_local, D)
        acc: list[Partial | None] = [None, None]
        for src in range(group.size):
            _merge_block(acc, q, kv[src, 0], kv[src, 1], _block(group.rank, src, layout.chunk), scale)
        out, lse = _merged(acc, q.dtype)
    record(ALLGATHER_ATTENTION, (q, k, v), out,
           {"group": group, "chunk": layout.chunk, "scale": scale, "lse": lse})
    return out


@derivative(ALLGATHER_ATTENTION, save=_save)
def _allgather_attention_backward(node: Any, grads: list[Any],
                                  create_graph: bool) -> tuple[Tensor, Tensor, Tensor]:
    no_double_backward("all-gather attention", create_graph)
    q, k, v, out, lse = node.saved
    group: ProcessGroup = node.attrs["group"]
    dout = incoming_grad(node, grads)
    kv = gather_unrecorded(stack([k, v]), group)  # gathered again rather than kept: O(T) memory per layer
    dq = zeros_like(q, dtype=lse.dtype)
    dkv = zeros_like(kv, dtype=lse.dtype)
    for src in range(group.size):
        block = _block(group.rank, src, node.attrs["chunk"])
        g = _block_grads(dout, q, kv[src, 0], kv[src, 1], out, lse, block, node.attrs["scale"])
        _add_block(dq, dkv.select(0, src), g, block)
    mine = reduce_scatter_unrecorded(dkv, group)  # every rank's gradient of my K/V, summed
    return dq.to(dtype=q.dtype), mine[0].to(dtype=k.dtype), mine[1].to(dtype=v.dtype)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                      scale: float) -> Tensor:
    W = group.size
    B, H, T_l, D = q.shape
    if H % W:
        raise DistArgumentError(f"ulysses attention: the number of heads ({H}) must be divisible by the "
                                f"context-parallel size {W}; use attn='ring' or 'allgather'")
    groups = H // k.shape[1]
    if groups > 1:  # q, k and v travel as one tensor: the shared K/V heads repeated to the query heads
        k, v = (t.unsqueeze(2).expand(B, t.shape[1], groups, T_l, D).reshape(B, H, T_l, D) for t in (k, v))
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


def _shares_heads(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """k and v (B, H_kv, T_local, D) fit q (B, H, T_local, D): H a multiple of H_kv."""
    return k.ndim == 4 and v.shape == k.shape and (k.shape[0], *k.shape[2:]) == (q.shape[0], *q.shape[2:]) \
        and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, layout: ChunkLayout,
                               kind: str = "ring", scale: float | None = None) -> Tensor:
    """Causal attention of this rank's queries (B, H, T_local, D) over the whole sharded sequence, k and v
    (B, H_kv, T_local, D) with H_kv a divisor of H (grouped-query attention when smaller)."""
    fn = ATTENTION.get(kind)
    if fn is None:
        raise DistArgumentError(f"context_parallel_attention: kind must be one of {', '.join(ATTENTION_KINDS)}, "
                                f"got {kind!r}")
    if q.ndim != 4 or not _shares_heads(q, k, v) or q.shape[2] * group.size != layout.seq_len:
        raise DistArgumentError(f"context_parallel_attention: q must be (B, H, T_local, D) and k, v (B, H_kv, "
                                f"T_local, D) with H a multiple of H_kv and T_local · cp = {layout.seq_len}, got "
                                f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)} on {group.size} rank(s)")
    sc = float(scale) if scale is not None else q.shape[-1] ** -0.5
    return fn(q, k, v, group, layout, sc)


__all__ = ["ALLGATHER_ATTENTION", "ATTENTION_KINDS", "RING_ATTENTION", "AttentionKind", "Partial",
           "allgather_attention", "attend", "context_parallel_attention", "merge_partials", "ring_attention",
           "ulysses_attention"]
