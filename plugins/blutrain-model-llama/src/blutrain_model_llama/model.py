"""A Llama-style decoder: pre-RMSNorm blocks of grouped-query attention with rotary position embeddings
and a SwiGLU MLP, no biases, an untied LM head (tying optional).

Module and parameter names are Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.
weight`` ...) and the rotary embedding uses its rotate-half layout, so a Hugging Face checkpoint loads
as it is stored (:mod:`blutrain_model_llama.hf`). Initialisation: N(0, 0.02) for linear and embedding
weights, the residual output projections (``o_proj``, ``down_proj``) scaled by 1/sqrt(2·n_layer) as
GPT-2's, RMSNorm weights one; weights come from the device's default generator.

Grouped-query attention: each of the ``n_kv_head`` K/V heads serves ``n_head / n_kv_head`` query heads.
Training attention is ``scaled_dot_product_attention(..., enable_gqa=True)`` on the (B, H, T, D) and
(B, H_kv, T, D) transposed views of the projections: the kernels read the shared K/V heads in place (query
head h reads K/V head h // group) and sum the K/V gradients over each group, so nothing is repeated or
copied. Decoding against the KV cache views q by groups and expands the cached K/V (a stride-0 view).
"""

from __future__ import annotations

import math
import os
from typing import Any

from blutrain.autograd import checkpoint, is_grad_enabled
from blutrain.models import ModelError, ModelParallelPlan, check_token_ids
from blutrain.models.sampling import sample_tokens
from blutrain.nn import AttentionCore, Embedding, KVCache, Linear, Module, ModuleList, RMSNorm, attend_cached
from blutrain.nn import init as nn_init
from blutrain.nn.module import is_plain
from blutrain.tensor import (
    Tensor,
    arange,
    cross_entropy,
    float32,
    float64,
    linear_add,
    linear_cross_entropy,
    rope,
    scaled_dot_product_attention,
    swiglu,
)
from blutrain.tensor.errors import ShapeError
from blutrain_model_llama.config import LlamaConfig


def causal_gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, H_kv, T, D), query head h reading K/V head
    h // (H / H_kv): grouped-query attention, the shared K/V heads never repeated."""
    return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class LlamaAttention(Module):
    """q/k/v/o projections (no biases), rotary embeddings on q and k, grouped-query causal attention.

    ``attention_core`` (:class:`blutrain.models.PlannedAttention`) replaces the attention step when set
    (context parallelism). ``n_head`` / ``n_kv_head`` are the heads this module computes (tensor
    parallelism divides them); ``head_dim`` stays the model's.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.k_proj = Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = Linear(config.n_head * self.head_dim, config.n_embd, bias=False)
        self.attention_core: AttentionCore | None = None

    def forward(self, x: Tensor, angles: tuple[Tensor, Tensor], residual: Tensor | None = None) -> Tensor:
        """``o_proj(attention(x))``, plus ``residual`` when given (added in o_proj's GEMM where it is a plain
        Linear); ``angles`` the (T, head_dim/2) cos and sin of x's positions."""
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).reshape(B, T, self.n_head, D)
        k = self.k_proj(x).reshape(B, T, self.n_kv_head, D)
        v = self.v_proj(x).reshape(B, T, self.n_kv_head, D).transpose(1, 2)
        q, k = rope(q, k, *angles)
        core = self.attention_core if self.attention_core is not None else causal_gqa_attention
        y = core(q.transpose(1, 2), k.transpose(1, 2), v).transpose(1, 2).reshape(B, T, self.n_head * D)
        if residual is not None and is_plain(self.o_proj, Linear):
            return linear_add(residual, y, self.o_proj.weight)
        out: Tensor = self.o_proj(y)
        return out if residual is None else residual + out

    def decode(self, x: Tensor, angles: tuple[Tensor, Tensor], cache: KVCache, layer: int,
               residual: Tensor | None = None) -> Tensor:
        """``forward`` for T new positions that follow the ``cache``'s (``angles`` theirs): their keys and
        values (after the rotary embedding) are appended to layer ``layer`` of the cache and each new query
        attends to every cached position and to the new ones up to itself. Inference only."""
        B, T, _ = x.shape
        D, kv = self.head_dim, self.n_kv_head
        q = self.q_proj(x).reshape(B, T, self.n_head, D)
        k = self.k_proj(x).reshape(B, T, kv, D)
        v = self.v_proj(x).reshape(B, T, kv, D).transpose(1, 2)
        q, k = rope(q, k, *angles)
        keys, values = cache.extend(layer, k.transpose(1, 2), v)
        S, group = keys.shape[2], self.n_head // kv
        q5 = q.transpose(1, 2).reshape(B, kv, group, T, D)
        k5, v5 = (t.unsqueeze(2).expand(B, kv, group, S, D) for t in (keys, values))
        y = attend_cached(q5, k5, v5)
        y = y.reshape(B, self.n_head, T, D).transpose(1, 2).reshape(B, T, self.n_head * D)
        out: Tensor = self.o_proj(y)
        return out if residual is None else residual + out

    def extra_repr(self) -> str:
        core = "" if self.attention_core is None else f", attention_core={self.attention_core!r}"
        return f"n_head={self.n_head}, n_kv_head={self.n_kv_head}, head_dim={self.head_dim}{core}"


class LlamaMLP(Module):
    """down_proj(silu(gate_proj(x)) · up_proj(x)): SwiGLU, the gate and product one ``swiglu`` kernel."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        h = swiglu(self.gate_proj(x), self.up_proj(x))
        if residual is not None and is_plain(self.down_proj, Linear):
            return linear_add(residual, h, self.down_proj.weight)
        out: Tensor = self.down_proj(h)
        return out if residual is None else residual + out


class LlamaBlock(Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); each residual added in its output projection's GEMM."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = _branch(self.self_attn, LlamaAttention, self.input_layernorm(x), x, (cos, sin))
        return _branch(self.mlp, LlamaMLP, self.post_attention_layernorm(x), x)

    def decode(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int) -> Tensor:
        """``forward`` for positions that follow the ``cache``'s (see :meth:`LlamaAttention.decode`)."""
        x = self.self_attn.decode(self.input_layernorm(x), (cos, sin), cache, layer, residual=x)
        return _branch(self.mlp, LlamaMLP, self.post_attention_layernorm(x), x)


def _branch(module: Module, cls: type[Module], h: Tensor, x: Tensor, *args: Any) -> Tensor:
    """``x + module(h)``: the module adds x itself when it is ``cls`` with no hooks."""
    if is_plain(module, cls):
        out: Tensor = module(h, *args, residual=x)
        return out
    return x + module(h, *args)  # type: ignore[no-any-return]


class LlamaModel(Module):
    """The trunk: token embedding, the blocks and the final RMSNorm ((B, T) ids → (B, T, n_embd))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.n_embd)
        self.layers = ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, eps=config.norm_eps)

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin (T, head_dim/2) of ``positions`` (T,) times each rotary frequency θ^(-2i/head_dim),
        computed in float64 (on the device, by kernels: a compiled step replays them) and rounded once to
        the weights' dtype (float32 for half weights), what the rope kernel reads. Hugging Face computes
        the angles in float32; the two differ by float32 rounding."""
        d = self.config.head_dim
        steps = arange(0, d, 2, dtype=float64, device=positions.device)
        inv_freq = (steps * (-math.log(self.config.rope_theta) / d)).exp()
        theta = positions.to(dtype=float64).unsqueeze(1) * inv_freq.unsqueeze(0)
        dtype = self.embed_tokens.weight.dtype
        dtype = float32 if dtype.itemsize == 2 else dtype
        return theta.cos().to(dtype=dtype), theta.sin().to(dtype=dtype)

    def forward(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        pos = arange(idx.shape[1], dtype="int64", device=idx.device) if positions is None else positions
        cos, sin = self.angles(pos)
        x: Tensor = self.embed_tokens(idx)
        recompute = (self.config.checkpoint_activations and self.training and is_grad_enabled()
                     and x.requires_grad)
        for block in self.layers:
            x = checkpoint(block, x, cos, sin) if recompute else block(x, cos, sin)
        out: Tensor = self.norm(x)
        return out

    def decode(self, idx: Tensor, cache: KVCache) -> Tensor:
        """Hidden states of the tokens ``idx`` (B, T) at the positions that follow the ``cache``'s, whose keys
        and values every layer appends to it: incremental decoding (inference only)."""
        start, T = cache.length, idx.shape[1]
        if start + T > self.config.block_size:
            raise ShapeError(f"LlamaModel.decode: {start} cached + {T} new positions exceed block_size "
                             f"{self.config.block_size}")
        cos, sin = self.angles(arange(start, start + T, dtype="int64", device=idx.device))
        x: Tensor = self.embed_tokens(idx)
        for layer, block in enumerate(self.layers):
            x = block.decode(x, cos, sin, cache, layer)
        out: Tensor = self.norm(x)
        return out

    def decodes_incrementally(self) -> bool:
        """Whether :meth:`decode` computes what ``forward`` does: every block and its attention are this
        package's own modules without hooks or a replaced attention core."""
        return is_plain(self, LlamaModel) and all(
            is_plain(b, LlamaBlock) and is_plain(b.self_attn, LlamaAttention) and b.self_attn.attention_core is None
            for b in self.layers)


class Llama(Module):
    """A Llama-style language model: ``model(idx, targets=None)`` returns ``(logits, loss)``."""

    # Megatron's cut for Llama (torchtitan's llama3 plan): q/k/v and gate/up column parallel, o/down row
    # parallel, query and K/V heads split, embedding and head vocab parallel.
    parallel_plan = ModelParallelPlan(
        blocks="model.layers", attention="self_attn", head_attributes=("n_head", "n_kv_head"),
        column={"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1, "mlp.gate_proj": 1,
                "mlp.up_proj": 1},
        row=("self_attn.o_proj", "mlp.down_proj"), vocab_embedding="model.embed_tokens", head="lm_head")

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise ModelError(f"Llama: config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        done: set[int] = set()
        for name, m in self.named_modules():
            if isinstance(m, (Linear, Embedding)) and id(m.weight) not in done:
                std = residual_std if name.endswith(("o_proj", "down_proj")) else 0.02
                nn_init.normal_(m.weight, 0.0, std)
                done.add(id(m.weight))

    def check_ids(self, idx: Tensor, argument: str = "idx", check_length: bool = True) -> None:
        """Refuse anything but (batch, time) integer token ids no longer than ``block_size``."""
        check_token_ids("Llama", idx, self.config.block_size, argument, check_length)

    def hidden_states(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """The final-RMSNorm hidden states (B, T, n_embd) of ``idx`` at ``positions`` (default 0 .. T-1)."""
        out: Tensor = self.model(idx, positions)
        return out

    def forward(self, idx: Tensor, targets: Tensor | None = None, *,
                return_logits: bool = True) -> tuple[Tensor | None, Tensor | None]:
        """Logits (B, T, vocab) and the mean cross-entropy against ``targets`` (-1 ignored); with
        ``return_logits=False`` the loss only, head and loss fused (``linear_cross_entropy``)."""
        self.check_ids(idx)
        x = self.hidden_states(idx)
        if targets is not None:
            if not isinstance(targets, Tensor) or targets.shape != idx.shape:
                got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
                raise ShapeError(f"Llama: targets must have the shape of idx {list(idx.shape)}, got {got}")
            if not return_logits and is_plain(self.lm_head, Linear):
                return None, linear_cross_entropy(x, self.lm_head.weight, targets, ignore_index=-1)
        logits: Tensor = self.lm_head(x)
        if targets is None:
            return logits, None
        B, T, V = logits.shape
        return logits, cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), ignore_index=-1)

    def flops_per_token(self, seq_len: int) -> int:
        """3 × the forward's FLOPs per token. Forward: each layer's GEMMs, 2 × (C·C for q and o each, C·C_kv for
        k and v each, with C_kv = n_kv_head × head size, and 3·C·F for SwiGLU's gate, up and down), and
        attention's two T-long products, 2 × 2 × T × C (every query head, whatever K/V heads it shares), counted
        whole as PaLM does; then the head, 2 × C × V. Norms, rotations and the embedding lookup are left out."""
        cfg = self.config
        c, f, v = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size
        c_kv = cfg.n_kv_head * (c // cfg.n_head)
        per_layer = 2 * (2 * c * c + 2 * c * c_kv + 3 * c * f) + 4 * seq_len * c
        return 3 * (cfg.n_layer * per_layer + 2 * c * v)

    def num_parameters(self) -> int:
        """Parameters counted once each (a tied head is the embedding)."""
        return sum(p.numel() for p in self.parameters())

    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None, use_cache: bool = True) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx``; see :func:`blutrain.models.sampling.sample_tokens`.
        ``use_cache`` (default): incremental decoding with a :class:`~blutrain.nn.KVCache` (the K/V heads
        cached once each, not repeated), unless a block or attention carries hooks or is replaced; without it
        every token recomputes the whole context (the same tokens for a seed)."""
        decode = self.model.decode if use_cache and self.model.decodes_incrementally() else None
        return sample_tokens(self, idx, max_new_tokens, temperature, top_k, seed, self.lm_head, decode)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **overrides: Any) -> Llama:
        """Load a Hugging Face ``LlamaForCausalLM`` directory (see :mod:`blutrain_model_llama.hf`)."""
        from blutrain_model_llama.hf import load_pretrained

        model: Llama = load_pretrained(cls, directory, **overrides)
        return model

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_bytes: int | None = None) -> None:
        """Write a Hugging Face ``LlamaForCausalLM`` directory (see :mod:`blutrain_model_llama.hf`)."""
        from blutrain_model_llama.hf import save_pretrained

        save_pretrained(self, directory, max_shard_bytes)


__all__ = ["Llama", "LlamaAttention", "LlamaBlock", "LlamaMLP", "LlamaModel", "causal_gqa_attention"]
