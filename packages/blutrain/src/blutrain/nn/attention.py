"""Causal multi-head self-attention as in GPT-2: QKV projection, fused attention, output projection."""

from __future__ import annotations

from collections.abc import Callable

from blutrain.nn.activation import Dropout
from blutrain.nn.errors import ModuleError
from blutrain.nn.kv_cache import KVCache
from blutrain.nn.linear import Linear, project
from blutrain.nn.module import Module
from blutrain.tensor import Tensor, ones, scaled_dot_product_attention, self_attention, tril
from blutrain.tensor.errors import ShapeError

# Causal attention of q (B, H, T, D) over k, v (B, H_kv, T, D), H a multiple of H_kv (query head h reads
# key/value head h // (H / H_kv)), returning (B, H, T, D): the step of an attention module that context
# parallelism replaces (blutrain.models.PlannedAttention).
AttentionCore = Callable[[Tensor, Tensor, Tensor], Tensor]


class CausalSelfAttention(Module):
    """``c_attn`` (n_embd → 3·n_embd: q, k, v in that order), causal attention per head, ``c_proj``.

    The attention itself is one ``self_attention(c_attn(x), n_head, is_causal=True)`` op over the packed
    projection, which keeps the per-query log-sum-exp for backward instead of the T×T probabilities: its
    kernels read q, k and v where c_attn wrote them and write the heads merged, and its backward writes
    the (B, T, 3C) gradient in one buffer, so no split, transpose, zero fill or sum runs around it.
    ``packed=False`` takes the general path instead (split, per-head ``scaled_dot_product_attention``,
    merge): the same values. ``dropout`` applies to the output projection (residual dropout); the
    attention kernels do not support dropout on the probabilities, so there is none there.

    ``forward(x, residual=r)`` returns ``r + self(x)``: c_proj's GEMM then adds the residual in its epilogue
    (``linear_add``) where nothing stands between (no dropout in training, no hooks on c_proj or the
    dropout, c_proj a plain Linear), else the sum is computed after the module's output as ever.
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, dropout: float = 0.0,
                 packed: bool = True) -> None:
        super().__init__()
        if n_head <= 0 or n_embd % n_head:
            raise ModuleError(f"CausalSelfAttention: n_embd ({n_embd}) must be a positive multiple of n_head "
                              f"({n_head})")
        self.n_embd = n_embd
        self.n_head = n_head
        self.c_attn = Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = Dropout(dropout)
        self.packed = packed
        self.attention_core: AttentionCore | None = None

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if x.ndim != 3 or x.shape[2] != self.n_embd:
            raise ShapeError(f"CausalSelfAttention: input must be (B, T, {self.n_embd}), got {list(x.shape)}")
        qkv = self.c_attn(x)
        if self.packed and self.attention_core is None:
            y = self_attention(qkv, self.n_head, is_causal=True)
        else:
            y = self._split_heads_attention(qkv)
        return project(self.c_proj, self.resid_dropout, y, residual)

    def decode(self, x: Tensor, cache: KVCache, layer: int, residual: Tensor | None = None) -> Tensor:
        """Attention of T new positions (``x``: B, T, n_embd) that follow the ``cache``'s positions: their
        keys and values are appended to layer ``layer`` of the cache, and each new query attends to every
        cached position and to the new ones up to itself. Returns what ``forward`` returns for those
        positions (``residual`` added the same way). For inference: hooks on this module do not run."""
        if x.ndim != 3 or x.shape[2] != self.n_embd:
            raise ShapeError(f"CausalSelfAttention: input must be (B, T, {self.n_embd}), got {list(x.shape)}")
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.reshape(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        keys, values = cache.extend(layer, k, v)
        y = attend_cached(q, keys, values)
        return project(self.c_proj, self.resid_dropout, y.transpose(1, 2).reshape(B, T, C), residual)

    def _split_heads_attention(self, qkv: Tensor) -> Tensor:
        B, T, C3 = qkv.shape
        C = C3 // 3
        hs = C // self.n_head
        q, k, v = qkv.split(C, dim=2)
        q = q.reshape(B, T, self.n_head, hs).transpose(1, 2)
        k = k.reshape(B, T, self.n_head, hs).transpose(1, 2)
        v = v.reshape(B, T, self.n_head, hs).transpose(1, 2)
        core = self.attention_core
        y = scaled_dot_product_attention(q, k, v, is_causal=True) if core is None else core(q, k, v)
        return y.transpose(1, 2).reshape(B, T, C)

    def extra_repr(self) -> str:
        packed = "" if self.packed else ", packed=False"
        core = "" if self.attention_core is None else f", attention_core={self.attention_core!r}"
        return f"n_embd={self.n_embd}, n_head={self.n_head}{packed}{core}"


def attend_cached(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Causal attention of the newest T positions' queries ``q`` (..., T, D) over every position so far: ``keys``
    and ``values`` (..., S, D), the cache with the new positions last. Query i is position S - T + i and sees
    keys 0 .. S - T + i: no mask for one new position, plain causal attention where nothing was cached."""
    T, S = q.shape[-2], keys.shape[-2]
    if T == 1:
        return scaled_dot_product_attention(q, keys, values)
    if S == T:
        return scaled_dot_product_attention(q, keys, values, is_causal=True)
    mask = tril(ones(T, S, dtype="bool", device=q.device), diagonal=S - T)
    return scaled_dot_product_attention(q, keys, values, attn_mask=mask)


__all__ = ["AttentionCore", "CausalSelfAttention", "attend_cached"]
