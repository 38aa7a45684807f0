"""tools/bench/gpt2.py's models and steps: the PyTorch references (nanoGPT-style GPT-2, a plain Llama), each
implementation's runner (one training step: zero_grad, forward, backward, clip, AdamW), the shared hyper-parameters
and the batches every configuration sees."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from bench.gpt2_measure import Clock, PhaseFn, no_phase


@dataclass(frozen=True)
class Hyper:
    """Optimisation settings shared by both frameworks (nanoGPT's GPT-2 recipe, constant learning rate)."""

    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    compile_passes: tuple[str, ...] | None = None  # blutrain-compile's pipeline (--compile-replace); None: default
    remat: bool | None = None  # blutrain-compile's rematerialize pass (--remat / --no-remat); None: the default
    model: str = "gpt2"  # the model family (--model): BluTrain's registered one and TORCH_MODELS' PyTorch one


GPT2_TOKENS = 50257  # the GPT-2 tokenizer's vocabulary; presets pad the embedding to 50304


# -- models and steps --------------------------------------------------------------------------------------
def torch_reference(cfg: Any) -> Any:
    """The PyTorch GPT-2 as nanoGPT writes it, with BluTrain's parameter names (so a state dict maps 1:1)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    C, nh = cfg.n_embd, cfg.n_head

    class CausalSelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # -1 heads and three equal parts: under tensor parallelism (tools/bench/dist_torch_tp.py) c_attn's
            # product is this rank's [q k v] of n_head / N heads; on one process, all of them
            B, T, _ = x.shape
            q, k, v = self.c_attn(x).chunk(3, dim=2)
            q, k, v = (z.view(B, T, -1, C // nh).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out: torch.Tensor = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))
            return out

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_fc = nn.Linear(C, 4 * C)
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(cfg.vocab_size, C), "wpe": nn.Embedding(cfg.block_size, C),
                "h": nn.ModuleList(Block() for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(C, eps=cfg.layer_norm_eps)})
            self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, 0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            t = self.transformer
            x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in t.h:
                x = block(x)
            logits = self.lm_head(t.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    return GPT()


def torch_llama_reference(cfg: Any) -> Any:
    """The PyTorch Llama-style decoder of the llama family's config (Hugging Face's LlamaForCausalLM written
    plainly: RMSNorm, rotate-half rotary embeddings, SDPA with grouped-query attention (``enable_gqa``: K/V
    heads not repeated), SwiGLU, no biases, untied head unless ``tie_embeddings``), with the same parameter
    names as BluTrain's Llama, so a state dict maps 1:1. Initialised as BluTrain's (normal 0.02, o/down
    projections scaled by 1/sqrt(2·n_layer), norms one). Needs torch >= 2.5 (``nn.RMSNorm``, ``enable_gqa``);
    not yet run here (no PyTorch in this environment): the device run of this tool is its first."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    C, H, KV, D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(C, H * D, bias=False)
            self.k_proj = nn.Linear(C, KV * D, bias=False)
            self.v_proj = nn.Linear(C, KV * D, bias=False)
            self.o_proj = nn.Linear(H * D, C, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            B, T, _ = x.shape
            q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
            k = self.k_proj(x).view(B, T, KV, D).transpose(1, 2)
            v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
            out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
            return out

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(C, cfg.ffn_hidden, bias=False)
            self.up_proj = nn.Linear(C, cfg.ffn_hidden, bias=False)
            self.down_proj = nn.Linear(cfg.ffn_hidden, C, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.RMSNorm(C, eps=cfg.norm_eps)
            self.self_attn = Attention()
            self.post_attention_layernorm = nn.RMSNorm(C, eps=cfg.norm_eps)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, C)
            self.model.layers = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.model.norm = nn.RMSNorm(C, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("o_proj.weight", "down_proj.weight")) \
                        else 0.02
                    nn.init.normal_(p, 0.0, std)
            self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D),
                                 persistent=False)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            freqs = torch.outer(torch.arange(idx.shape[1], device=idx.device).float(), self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            x = self.model.embed_tokens(idx)
            for block in self.model.layers:
                x = block(x, cos, sin)
            logits = self.lm_head(self.model.norm(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)

    return Llama()


# the PyTorch implementation of each family this tool compares against
TORCH_MODELS: dict[str, Callable[[Any], Any]] = {"gpt2": torch_reference, "llama": torch_llama_reference}


class TorchRunner:
    """PyTorch eager or ``torch.compile`` of the reference model, with torch.optim.AdamW."""

    def __init__(self, cfg: Any, device: str, precision: str, hp: Hyper, compiled: bool,
                 foreach: bool = False) -> None:
        import torch

        self.torch = torch
        self.impl = "torch-compile" if compiled else "torch"
        self.device = device
        self.clock = Clock("torch" if device == "cuda" else "host")
        torch.manual_seed(hp.seed)
        with torch.device(device):
            self.model = TORCH_MODELS[hp.model](cfg)
        self.params = list(self.model.parameters())
        groups = [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": hp.weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        kw: dict[str, Any] = {"lr": hp.lr, "betas": hp.betas, "eps": hp.eps}
        try:
            if foreach:  # the same training through other kernels: the parity noise floor's second run
                raise ValueError("foreach asked for")
            self.opt = torch.optim.AdamW(groups, fused=True, **kw)
            self.optimizer = "torch.optim.AdamW(fused=True)"
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(groups, foreach=True, **kw)
            self.optimizer = "torch.optim.AdamW(foreach=True)"
        self.clip = hp.clip
        self.forward = torch.compile(self.model) if compiled else self.model
        self.bf16 = precision == "bf16"
        self.sdpa_context: Callable[[], Any] = contextlib.nullcontext
        if foreach:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.sdpa_context = lambda: sdpa_kernel(SDPBackend.MATH)
            self.optimizer += ", attention by the math backend"

    def stage(self, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> Any:
        return tuple(self.torch.from_numpy(a).to(self.device) for a in (x, y))

    def step(self, batch: Any, phase: PhaseFn = no_phase) -> Any:
        torch = self.torch
        x, y = batch
        with phase("forward"):
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.bf16), self.sdpa_context():
                loss = self.forward(x, y)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.opt.step()
        return loss.detach()

    def loss_value(self, loss: Any) -> float:
        return float(loss.item())

    def modules(self) -> list[tuple[str, Any]]:
        return list(self.model.named_modules())

    def state_numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        """The model's weights as float32 NumPy arrays under BluTrain's names (a tied head once)."""
        tied = self.model.lm_head.weight is next(m.weight for m in self.model.modules()
                                                 if isinstance(m, self.torch.nn.Embedding))
        return {k: v.detach().float().cpu().numpy() for k, v in self.model.state_dict().items()
                if not (tied and k == "lm_head.weight")}


class BluTrainRunner:
    """BluTrain eager: GPT2, the adamw plugin, clip_grad_norm_, blutrain.amp.autocast for bf16."""

    impl = "blutrain"

    def __init__(self, cfg: Any, device: str, precision: str, hp: Hyper,
                 state: dict[str, np.ndarray[Any, Any]] | None = None) -> None:
        import blutrain.tensor as bt
        from blutrain.amp import autocast
        from blutrain.models import model_spec
        from blutrain.optim import clip_grad_norm_, create, weight_decay_groups

        self.bt = bt
        self.device = device
        self.clock = Clock("cupy" if device == "cuda" else "host")
        bt.manual_seed(hp.seed)
        self.model = model_spec(hp.model).build(cfg)
        if state is not None:
            self.model.load_state_dict({k: bt.from_numpy(v) for k, v in state.items()})
        self.model.to(device)
        self.model.train()
        self.params = list(self.model.parameters())
        self.opt = create("adamw", weight_decay_groups(self.params, hp.weight_decay), lr=hp.lr, betas=hp.betas,
                          eps=hp.eps)
        self.optimizer = "blutrain adamw plugin (multi-tensor kernel)"
        self.clip = hp.clip
        self.clip_fn = clip_grad_norm_
        self.autocast = autocast(dtype="bfloat16", enabled=precision == "bf16")

    def stage(self, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> Any:
        return tuple(self.bt.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in (x, y))

    def step(self, batch: Any, phase: PhaseFn = no_phase) -> Any:
        x, y = batch
        with phase("forward"):
            self.opt.zero_grad(set_to_none=True)
            with self.autocast:
                loss = self.model(x, y, return_logits=False)[1]  # the head and loss fused: no logits
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if self.clip > 0:
                self.clip_fn(self.params, self.clip)
            self.opt.step()
        return loss

    def loss_value(self, loss: Any) -> float:
        return float(loss.item())

    def modules(self) -> list[tuple[str, Any]]:
        return list(self.model.named_modules())

    def state_numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        return {k: np.asarray(v.cpu()) for k, v in self.model.state_dict().items()}


class BluTrainCompiledRunner(BluTrainRunner):
    """BluTrain compiled: the whole step through ``blutrain.compiler.compile`` (no phases: it is one program)."""

    impl = "blutrain-compile"

    def __init__(self, cfg: Any, device: str, precision: str, hp: Hyper,
                 state: dict[str, np.ndarray[Any, Any]] | None = None) -> None:
        super().__init__(cfg, device, precision, hp, state)
        from blutrain.compiler import compile as compile_step

        # with --compile-replace the pipeline has the rematerialize pass (or its replacement) already
        remat = hp.remat if hp.compile_passes is None else None
        self.compiled = compile_step(self._whole_step, passes=hp.compile_passes, remat=remat)

    def close(self) -> None:
        """Drop the compiled graphs and their memory now: a stage's four configurations share the GPU, and
        the next stage must not start beside this one's buffers (with them, a later configuration can run out
        of memory that an earlier one still holds)."""
        self.compiled.reset()

    def _whole_step(self, x: Any, y: Any) -> Any:
        with self.autocast:
            loss = self.model(x, y, return_logits=False)[1]
        loss.backward()
        if self.clip > 0:
            self.clip_fn(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def step(self, batch: Any, phase: PhaseFn = no_phase) -> Any:
        with phase("step"):
            return self.compiled(*batch)


Runner = TorchRunner | BluTrainRunner


def compile_pipeline(replacements: list[str], remat: bool | None = None) -> tuple[str, ...] | None:
    """The compiler's default pipeline, with the ``rematerialize`` pass or without it as ``remat`` says (None: as
    it is), then each ``OLD=NEW`` of ``--compile-replace`` applied (``rematerialize=rematerialize-activations``
    with ``--remat``); None for no replacement (``compile``'s own ``remat`` then places the pass)."""
    if not replacements:
        return None
    from blutrain.compiler import default_pipeline, with_remat

    pipeline = list(default_pipeline() if remat is None else with_remat(default_pipeline(), remat))
    for spec in replacements:
        old, sep, new = spec.partition("=")
        if not sep or old not in pipeline or not new:
            raise SystemExit(f"--compile-replace: expected OLD=NEW with OLD one of {', '.join(pipeline)}, "
                             f"got {spec!r}")
        pipeline[pipeline.index(old)] = new
    return tuple(pipeline)


def build_runner(impl: str, cfg: Any, device: str, precision: str, hp: Hyper,
                 state: dict[str, np.ndarray[Any, Any]] | None = None) -> Runner:
    if impl == "blutrain":
        return BluTrainRunner(cfg, device, precision, hp, state)
    if impl == "blutrain-compile":
        return BluTrainCompiledRunner(cfg, device, precision, hp, state)
    return TorchRunner(cfg, device, precision, hp, compiled=impl == "torch-compile")


def set_precision(precision: str, device: str, have_torch: bool) -> None:
    """TF32 on or off for float32 GEMMs, on both sides (bf16 autocast leaves float32 GEMMs strict)."""
    if have_torch:
        import torch

        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    import blutrain.tensor as bt

    bt.device(device).backend.set_tf32(precision == "tf32")  # a backend without TF32 computes float32 either way


# ``--data stdlib``: the corpus `blutrain train` uses by default (real text, so a loss that falls steadily)
BUILTIN_DATA = "stdlib"


# -- batches -----------------------------------------------------------------------------------------------
class Batches:
    """The same (x, y) int64 batches for every configuration: random tokens, or ``--data`` shards."""

    def __init__(self, data: str | None, vocab: int, batch: int, seq: int, seed: int) -> None:
        self.batch, self.seq = batch, seq
        self.rng = np.random.default_rng(seed)
        self.high = min(vocab, GPT2_TOKENS)
        self.loader = None
        if data == BUILTIN_DATA:
            from blutrain.data import stdlib_corpus

            data = stdlib_corpus().train_pattern
        if data:
            from blutrain.data.loader import TokenLoader

            self.loader = TokenLoader(data, batch, seq, seed=seed, vocab_size=vocab)
        self.source = describe_data(data, vocab)

    def take(self, n: int) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
        out = []
        for _ in range(n):
            if self.loader is not None:
                x, y = self.loader.next_batch()
            else:
                a = self.rng.integers(0, self.high, size=(self.batch, self.seq + 1), dtype=np.int64)
                x, y = a[:, :-1], a[:, 1:]
            out.append((np.ascontiguousarray(x), np.ascontiguousarray(y)))
        return out


def close_runner(runner: Runner) -> None:
    """Drop a compiled runner's graphs and their memory now (BluTrain compiled); the others hold none."""
    if isinstance(runner, BluTrainCompiledRunner):
        runner.close()


def describe_data(data: str | None, vocab: int) -> str:
    if data == BUILTIN_DATA:
        return "the built-in corpus (this Python's standard-library sources, byte tokens)"
    return f"shards {data}" if data else f"uniform random tokens in [0, {min(vocab, GPT2_TOKENS)})"
