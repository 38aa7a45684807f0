"""The architecture of a Llama-style model, and its presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from blutrain.models import ModelError

# Name → architecture. ``tiny`` trains on the CPU (byte vocabulary, like GPT-2's tiny); ``llama-1b`` is
# the 1.1 B shape of TinyLlama (22 layers, d 2048, 32 heads sharing 4 K/V heads, SwiGLU 5632, vocab
# 32000, T 2048); ``llama-8b`` is Llama 3 8B's shape, for memory planning.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "ffn_hidden": 352, "block_size": 256,
             "vocab_size": 256},
    "llama-1b": {"n_layer": 22, "n_head": 32, "n_kv_head": 4, "n_embd": 2048, "ffn_hidden": 5632,
                 "block_size": 2048, "vocab_size": 32000},
    "llama-8b": {"n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "ffn_hidden": 14336,
                 "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000.0},
}


@dataclass
class LlamaConfig:
    """A Llama-style decoder: pre-RMSNorm blocks of grouped-query attention with rotary embeddings and a
    SwiGLU MLP, no biases; the LM head untied unless ``tie_embeddings``."""

    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 22
    n_head: int = 32
    n_kv_head: int = 4
    n_embd: int = 2048
    ffn_hidden: int = 5632
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelError(f"LlamaConfig: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ModelError(f"LlamaConfig: n_embd ({self.n_embd}) must be n_head ({self.n_head}) × an even head "
                             "size (rotary embeddings rotate pairs)")
        if self.n_head % self.n_kv_head:
            raise ModelError(f"LlamaConfig: n_head ({self.n_head}) must be a multiple of n_kv_head "
                             f"({self.n_kv_head}): each K/V head serves n_head / n_kv_head query heads")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ModelError(f"LlamaConfig: {name} must be a positive number, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The named preset with ``overrides`` applied."""
        if name not in PRESETS:
            raise ModelError(f"LlamaConfig.preset: unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ModelError(f"LlamaConfig.preset: unknown field(s) {', '.join(unknown)}; fields are "
                             f"{', '.join(sorted(known))}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = ["PRESETS", "LlamaConfig"]
