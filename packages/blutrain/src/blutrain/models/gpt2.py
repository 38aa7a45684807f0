"""GPT-2: a pre-LayerNorm decoder with learned positions, a tied LM head and a GELU-tanh MLP.

Module and parameter names are those of Hugging Face's ``GPT2LMHeadModel`` (``transformer.h.0.attn.
c_attn.weight`` ...), so interop is a transposition of the four Conv1D weights and nothing else.
Initialisation follows GPT-2 / nanoGPT: N(0, 0.02) for linear and embedding weights, residual
output projections (``c_proj``) scaled by 1/sqrt(2·n_layer) so the residual stream's variance does
not grow with depth, zero biases, LayerNorm ones/zeros. Weights are drawn from the device's default
generator, so ``blutrain.tensor.manual_seed`` before construction makes them reproducible.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.autograd import checkpoint, is_grad_enabled
from blutrain.models.errors import ModelError, PretrainedError
from blutrain.models.parallel_plan import ModelParallelPlan
from blutrain.models.sampling import sample_tokens
from blutrain.models.spec import check_token_ids
from blutrain.nn import (
    GELU,
    CausalSelfAttention,
    Dropout,
    Embedding,
    KVCache,
    LayerNorm,
    Linear,
    Module,
    ModuleList,
)
from blutrain.nn import init as nn_init
from blutrain.nn.linear import project
from blutrain.nn.module import is_plain
from blutrain.tensor import (
    Tensor,
    arange,
    cross_entropy,
    linear_cross_entropy,
    linear_gelu,
)
from blutrain.tensor.errors import ShapeError
from blutrain.tensor.serialization import SerializationError, load_file, save_file

# Name → architecture. ``tiny`` is the model `blutrain train` trains with no arguments on the byte-level
# stdlib corpus: ~0.8 M parameters sized so that 300 steps of 16×128 tokens run in about two minutes on
# two CPU cores (see README); the GPT-2 sizes pad the vocabulary 50257 → 50304 (a multiple of 128)
# as nanoGPT does, which makes the LM-head GEMM faster and changes nothing else.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 256, "vocab_size": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304},
    "gpt2-350m": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "vocab_size": 50304},
    "gpt2-774m": {"n_layer": 36, "n_head": 20, "n_embd": 1280, "block_size": 1024, "vocab_size": 50304},
    "gpt2-1558m": {"n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024, "vocab_size": 50304},
}

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Hugging Face's GPT-2 stores these four as Conv1D weights, (in_features, out_features): transposed.
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Non-parameter buffers some Hugging Face files carry (the causal mask); they hold no weights.
_HF_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass
class GPT2Config:
    """The architecture of a GPT-2 model; ``GPT2Config.preset(name, **overrides)`` starts from a preset."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelError(f"GPT2Config: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ModelError(f"GPT2Config: n_embd ({self.n_embd}) must be divisible by n_head "
                             f"({self.n_head})")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"GPT2Config: dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.layer_norm_eps, (int, float)) or self.layer_norm_eps <= 0:
            raise ModelError(f"GPT2Config: layer_norm_eps must be positive, got {self.layer_norm_eps!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPT2Config:
        """The named preset with ``overrides`` applied (e.g. ``preset("tiny", vocab_size=50257)``)."""
        if name not in PRESETS:
            raise ModelError(f"GPT2Config.preset: unknown preset {name!r}; expected one of "
                             f"{', '.join(PRESETS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ModelError(f"GPT2Config.preset: unknown field(s) {', '.join(unknown)}; fields are "
                             f"{', '.join(sorted(known))}")
        return cls(**{**PRESETS[name], **overrides})

    @staticmethod
    def presets() -> list[str]:
        return list(PRESETS)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **overrides: Any) -> GPT2Config:
        """The architecture in a Hugging Face GPT-2 directory's ``config.json``, with ``overrides`` applied
        (fields of this class, e.g. ``dropout``)."""
        return _config_from_hf(Path(directory) / CONFIG_NAME, overrides)

    def flops_per_token(self, seq_len: int) -> int:
        """3 × the forward's FLOPs per token (backward costs twice the forward). Forward: each layer's four
        weight GEMMs, 2 × (3C² + C² + 4C² + 4C²) = 24C², and attention's two T-long products (q·kᵀ and the
        weighted sum of v), 2 × 2 × T × C, counted whole as PaLM does; then the LM head, 2 × C × V. Biases,
        norms, softmax and the embedding lookup are left out."""
        c, v = self.n_embd, self.vocab_size
        return 3 * (self.n_layer * (24 * c * c + 4 * seq_len * c) + 2 * c * v)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MLP(Module):
    """c_fc (n_embd → 4·n_embd), GELU-tanh, c_proj (4·n_embd → n_embd), residual dropout.

    c_fc and the activation are one op (``linear_gelu``: on cuda in half precision one GEMM whose epilogue
    adds the bias and applies GELU), which saves a pass over the 4·n_embd activations each way; the
    parameters are c_fc's as ever. Any other activation module, or a forward hook on c_fc or the
    activation, takes the plain module path.
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = GELU(approximate="tanh")
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)
        self.dropout = Dropout(config.dropout)

    def _fusable(self) -> bool:
        fc, act = self.c_fc, self.gelu
        return is_plain(fc, Linear) and is_plain(act, GELU)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """``mlp(x)``, or ``residual + mlp(x)`` with c_proj adding the residual in its GEMM (``project``)."""
        if self._fusable():
            h = linear_gelu(x, self.c_fc.weight, self.c_fc.bias, self.gelu.approximate)
        else:
            h = self.gelu(self.c_fc(x))
        return project(self.c_proj, self.dropout, h, residual)


class Block(Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, dropout=config.dropout)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        # The residual goes into each branch, whose output projection adds it in its GEMM's epilogue,
        # where the branch is this package's own module without hooks (a hook sees the branch's output,
        # and a parallel plugin's replacement takes x alone).
        x = _branch(self.attn, CausalSelfAttention, self.ln_1(x), x)
        return _branch(self.mlp, MLP, self.ln_2(x), x)

    def decode(self, x: Tensor, cache: KVCache, layer: int) -> Tensor:
        """``forward`` for positions that follow the ``cache``'s (see :meth:`CausalSelfAttention.decode`)."""
        x = self.attn.decode(self.ln_1(x), cache, layer, residual=x)
        return _branch(self.mlp, MLP, self.ln_2(x), x)


def _branch(module: Module, cls: type[Module], h: Tensor, x: Tensor) -> Tensor:
    """``x + module(h)``: the module adds x itself when it is ``cls`` with no hooks."""
    if is_plain(module, cls):
        out: Tensor = module(h, residual=x)
        return out
    return x + module(h)  # type: ignore[no-any-return]



class Transformer(Module):
    """Embeddings, the blocks and the final LayerNorm: token ids (B, T) → hidden states (B, T, n_embd)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout)
        self.h = ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_eps)

    def forward(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """Hidden states of tokens ``idx`` (B, T) at ``positions`` (T,), by default ``0 .. T-1``."""
        pos = arange(idx.shape[1], dtype="int64", device=idx.device) if positions is None else positions
        x: Tensor = self.drop(self.wte(idx) + self.wpe(pos))
        # Checkpointing keeps each block's input and recomputes its activations in backward; it only
        # pays when a graph is being recorded, and needs an input that requires grad to hang the node on.
        recompute = (self.config.checkpoint_activations and self.training and is_grad_enabled()
                     and x.requires_grad)
        for block in self.h:
            x = checkpoint(block, x) if recompute else block(x)
        out: Tensor = self.ln_f(x)
        return out

    def decode(self, idx: Tensor, cache: KVCache) -> Tensor:
        """Hidden states of the tokens ``idx`` (B, T) at the positions that follow the ``cache``'s, whose
        keys and values every layer appends to it: incremental decoding (inference only)."""
        start, T = cache.length, idx.shape[1]
        if start + T > self.config.block_size:
            raise ShapeError(f"Transformer.decode: {start} cached + {T} new positions exceed block_size "
                             f"{self.config.block_size}")
        pos = arange(start, start + T, dtype="int64", device=idx.device)
        x: Tensor = self.drop(self.wte(idx) + self.wpe(pos))
        for layer, block in enumerate(self.h):
            x = block.decode(x, cache, layer)
        out: Tensor = self.ln_f(x)
        return out

    def decodes_incrementally(self) -> bool:
        """Whether :meth:`decode` computes what ``forward`` does: every block and its attention are this
        package's own modules without hooks or a replaced attention core (a plugin's replacement or a hook
        needs the whole forward)."""
        return is_plain(self, Transformer) and all(
            is_plain(b, Block) and is_plain(b.attn, CausalSelfAttention) and b.attn.attention_core is None
            for b in self.h)


class GPT2(Module):
    """GPT-2 language model. ``model(idx, targets=None)`` returns ``(logits, loss)`` as nanoGPT's does."""

    # Megatron's cut: q/k/v (one fused Linear, three parts) and c_fc column parallel, the output
    # projections row parallel, heads split, the token embedding and the tied head vocab parallel.
    parallel_plan = ModelParallelPlan(
        blocks="transformer.h", attention="attn", head_attributes=("n_head",),
        column={"attn.c_attn": 3, "mlp.c_fc": 1}, row=("attn.c_proj", "mlp.c_proj"),
        vocab_embedding="transformer.wte", head="lm_head")

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise ModelError(f"GPT2: config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one tensor, listed once by parameters()
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        done: set[int] = set()
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                if id(m.weight) not in done:
                    nn_init.normal_(m.weight, 0.0, residual_std if name.endswith("c_proj") else 0.02)
                    done.add(id(m.weight))
                if m.bias is not None:
                    nn_init.zeros_(m.bias)
            elif isinstance(m, Embedding) and id(m.weight) not in done:
                nn_init.normal_(m.weight, 0.0, 0.02)
                done.add(id(m.weight))
            elif isinstance(m, LayerNorm):
                if m.weight is not None:
                    nn_init.ones_(m.weight)
                if m.bias is not None:
                    nn_init.zeros_(m.bias)

    # -- forward -----------------------------------------------------------------------------
    def check_ids(self, idx: Tensor, argument: str = "idx", check_length: bool = True) -> None:
        """Refuse anything but (batch, time) integer token ids no longer than ``block_size``."""
        check_token_ids("GPT2", idx, self.config.block_size, argument, check_length)

    def forward(self, idx: Tensor, targets: Tensor | None = None, *,
                return_logits: bool = True) -> tuple[Tensor | None, Tensor | None]:
        """Logits (B, T, vocab) for every position, and the mean cross-entropy against ``targets``
        (B, T) when given (positions whose target is -1 are ignored).

        ``return_logits=False`` with targets computes the loss without the logits
        (:func:`~blutrain.tensor.linear_cross_entropy`, the head and the loss fused chunk by chunk)
        and returns ``(None, loss)``: for training, where the [B, T, vocab] logits and their gradient
        are the largest tensors of the step (2 × 3 GiB for GPT-2 124M at 16 × 1024 in float32).
        """
        self.check_ids(idx)
        x = self.hidden_states(idx)
        if targets is not None:
            if not isinstance(targets, Tensor) or targets.shape != idx.shape:
                got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
                raise ShapeError(f"GPT2: targets must have the shape of idx {list(idx.shape)}, got {got}")
            if not return_logits:
                return None, linear_cross_entropy(x, self.lm_head.weight, targets, ignore_index=-1)
        logits: Tensor = self.lm_head(x)
        if targets is None:
            return logits, None
        B, T, V = logits.shape
        loss = cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    def hidden_states(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """The final-LayerNorm hidden states (B, T, n_embd) of ``idx`` at ``positions`` (default 0 .. T-1)."""
        out: Tensor = self.transformer(idx, positions)
        return out

    def flops_per_token(self, seq_len: int) -> int:
        """The training FLOPs per token of this architecture (:meth:`GPT2Config.flops_per_token`)."""
        return self.config.flops_per_token(seq_len)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters counted once each (the tied head is the token embedding); ``non_embedding``
        leaves out the position embedding, as nanoGPT reports."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    # -- sampling ----------------------------------------------------------------------------
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None, use_cache: bool = True) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return the (B, T + new) ids.

        Runs in eval mode under ``no_grad`` (the previous mode is restored). The context is cropped
        to the last ``block_size`` tokens. ``temperature=0`` picks the most likely token; ``top_k``
        keeps the k most likely. With ``seed`` the draws come from a dedicated generator, so the
        result depends only on the model, the prompt and the seed, and the default generator is left
        untouched; without it they come from the device's default generator (``manual_seed``).
        Sampling happens on the host: one (B, vocab) copy per token, which is cheap next to a forward.

        ``use_cache`` (default): incremental decoding with a :class:`~blutrain.nn.KVCache`: the prompt
        runs once, then each step runs only the newest token through the layers, its query attending to
        the cached keys and values. Once the sequence outgrows ``block_size`` the window slides and every
        position's embedding changes, so each later step recomputes the cropped context (as without the
        cache). A model whose transformer, blocks or attention carry hooks or are replaced by a plugin
        decodes without the cache. ``use_cache=False`` recomputes the whole context for every token.
        """
        decode = self.transformer.decode if use_cache and self.transformer.decodes_incrementally() else None
        return sample_tokens(self, idx, max_new_tokens, temperature, top_k, seed, self.lm_head, decode)

    # -- Hugging Face layout -----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **overrides: Any) -> GPT2:
        """Load a Hugging Face GPT-2 directory: ``config.json`` and ``model.safetensors`` (names with or
        without the ``transformer.`` prefix; Conv1D weights transposed; an optional ``lm_head.weight``
        must equal the token embedding). ``overrides`` change config fields (e.g. ``dropout``).
        Only safetensors is read, never pickle."""
        model = cls(GPT2Config.from_pretrained(directory, **overrides))
        model.load_state_dict(load_pretrained_state(directory))
        return model

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the Hugging Face GPT-2 layout (Conv1D
        weights transposed, ``transformer.`` prefix, the tied head omitted, no causal-mask buffers)."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        c = self.config
        hf_config = {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
            "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
            "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": c.layer_norm_eps, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
            "attn_pdrop": 0.0, "tie_word_embeddings": True,
        }
        tensors: dict[str, Tensor] = {}
        for name, t in self.state_dict().items():
            tensors[name] = t.t().contiguous() if name.endswith(_CONV1D_SUFFIXES) else t
        save_file(tensors, root / WEIGHTS_NAME, metadata={"format": "pt"})
        tmp = root / (CONFIG_NAME + ".tmp")
        tmp.write_text(json.dumps(hf_config, indent=2) + "\n")
        os.replace(tmp, root / CONFIG_NAME)


def load_pretrained_state(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The weights of a Hugging Face GPT-2 directory's ``model.safetensors`` as this model's state dict
    (names with the ``transformer.`` prefix, Conv1D weights transposed, the tied head left out), on the
    CPU; ``load_state_dict`` checks them against a model's shapes. Only safetensors is read, never pickle."""
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise PretrainedError(f"{weights}: not found; from_pretrained reads safetensors only (no pickle "
                              "files such as pytorch_model.bin)")
    try:
        raw = load_file(weights)
    except SerializationError as exc:  # names the file and what is wrong; nothing else escapes load_file
        raise PretrainedError(str(exc)) from exc
    return _state_from_hf(raw, weights)


def _config_from_hf(path: Path, overrides: dict[str, Any]) -> GPT2Config:
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise PretrainedError(f"{path}: not found; a pretrained directory holds config.json and "
                              "model.safetensors") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PretrainedError(f"{path}: cannot read JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise PretrainedError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    missing = [k for k in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions") if k not in hf]
    if missing:
        raise PretrainedError(f"{path}: missing GPT-2 config key(s) {', '.join(missing)}")
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise PretrainedError(f"{path}: activation_function must be one of {', '.join(_TANH_GELUS)} "
                              "(GELU-tanh), "
                              f"got {act!r}")
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * hf["n_embd"]:
        raise PretrainedError(f"{path}: n_inner must be null or 4·n_embd = {4 * hf['n_embd']}, got {n_inner}")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise PretrainedError(f"{path}: scale_attn_by_inverse_layer_idx=true is not supported")
    values: dict[str, Any] = {"n_embd": hf["n_embd"], "n_layer": hf["n_layer"], "n_head": hf["n_head"],
                              "vocab_size": hf["vocab_size"], "block_size": hf["n_positions"],
                              "layer_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5))}
    known = {f.name for f in fields(GPT2Config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ModelError(f"from_pretrained: unknown config field(s) {', '.join(unknown)}; fields are "
                         f"{', '.join(sorted(known))}")
    values.update(overrides)
    return GPT2Config(**values)


def _state_from_hf(raw: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """Hugging Face names and layouts → this model's state dict (checked by load_state_dict)."""
    state: dict[str, Tensor] = {}
    head: Tensor | None = None
    for key, t in raw.items():
        if key.endswith(_HF_BUFFER_SUFFIXES):
            continue
        if key == "lm_head.weight":
            head = t
            continue
        name = key if key.startswith("transformer.") else "transformer." + key
        if name.endswith(_CONV1D_SUFFIXES):
            if t.ndim != 2:
                raise PretrainedError(f"{path}: {key} must be 2-D (Conv1D weight), got shape {list(t.shape)}")
            t = t.t().contiguous()
        if name in state:
            raise PretrainedError(f"{path}: {key} appears twice (with and without the 'transformer.' prefix)")
        state[name] = t
    if head is not None:
        wte = state.get("transformer.wte.weight")
        if wte is not None and (head.shape != wte.shape
                                or not np.array_equal(np.asarray(head), np.asarray(wte))):
            raise PretrainedError(f"{path}: lm_head.weight differs from the token embedding wte.weight; "
                                  "only GPT-2 with a tied head is supported")
    return state


__all__ = ["CONFIG_NAME", "GPT2", "MLP", "PRESETS", "WEIGHTS_NAME", "Block", "GPT2Config", "Transformer",
           "load_pretrained_state"]
