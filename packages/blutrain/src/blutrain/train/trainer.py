"""The training loop: data, model, optimizer plugin, schedule, clipping, evaluation, checkpoints.

One step = ``grad_accum_steps`` micro-batches of forward + backward, one clip, one optimizer step.
Everything that decides the numbers (model weights, optimizer state, loader position, RNG states,
step) is in the checkpoint, so a resumed CPU run reproduces an uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.data import TokenLoader, get_tokenizer, stdlib_corpus
from blutrain.data.prepare import PrepareReport
from blutrain.models.gpt2 import GPT2, GPT2Config
from blutrain.optim import clip_grad_norm_, create, warmup_cosine, weight_decay_groups
from blutrain.tensor import plugins
from blutrain.train.checkpoint import load_checkpoint, save_checkpoint
from blutrain.train.config import ConfigError, TrainConfig


def resolve_device(name: str) -> str:
    """``auto`` → cuda when a CUDA backend is installed and sees a GPU, else cpu."""
    if name != "auto":
        bt.device(name)  # validates against installed backends
        return name
    registry = bt.backends()
    if "cuda" in registry and registry.get("cuda").is_available():
        return "cuda"
    return "cpu"


@dataclass
class Dataset:
    train_pattern: str
    val_pattern: str | None
    vocab_size: int
    tokenizer: str
    baseline_nats: float | None


def resolve_data(cfg: TrainConfig) -> Dataset:
    if cfg.data is None:
        report = stdlib_corpus()
        return Dataset(report.train_pattern, report.val_pattern, report.vocab_size, "byte",
                       report.val_entropy_nats)
    path = Path(cfg.data)
    if path.is_dir() and (path / "dataset.json").exists():
        report = PrepareReport.read(path)
        return Dataset(report.train_pattern, report.val_pattern, report.vocab_size, report.tokenizer,
                       report.val_entropy_nats)
    vocab = 256 if cfg.tokenizer == "byte" else 50257
    return Dataset(str(path), None, vocab, cfg.tokenizer, None)


def _emit(event: str, state: dict[str, Any]) -> None:
    hook = getattr(plugins.get_plugin_manager().hook, "blutrain_on_train_event", None)
    if hook is not None and hook.get_hookimpls():
        hook(event=event, state=state)


class Trainer:
    """Trains a GPT-2 model as ``TrainConfig`` says; ``run()`` returns the final metrics."""

    def __init__(self, cfg: TrainConfig, stream: TextIO | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.stream = stream or sys.stdout
        self.device = resolve_device(cfg.device)
        self._configure_precision()
        from blutrain.train import hookspecs

        plugins.add_hookspecs(hookspecs)
        bt.manual_seed(cfg.seed)
        self.data = resolve_data(cfg)
        overrides = dict(cfg.model_overrides)
        if cfg.preset == "tiny":
            overrides.setdefault("vocab_size", self.data.vocab_size)
        self.model_config = GPT2Config.preset(cfg.preset, **overrides)
        if cfg.seq_len > self.model_config.block_size:
            raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's block_size {self.model_config.block_size}")
        if self.data.vocab_size > self.model_config.vocab_size:
            raise ConfigError(f"the data's vocabulary ({self.data.vocab_size}) is larger than the model's "
                              f"({self.model_config.vocab_size})")
        self.model = GPT2(self.model_config).to(self.device)
        groups = weight_decay_groups(self.model.parameters(), cfg.weight_decay)
        # nanoGPT's Adam betas; other optimizers take their own defaults
        extra = {"betas": (0.9, 0.95)} if cfg.optimizer == "adamw" else {}
        self.optimizer = create(cfg.optimizer, groups, lr=cfg.lr, **extra)
        self.loader = TokenLoader(self.data.train_pattern, cfg.batch_size, cfg.seq_len, seed=cfg.seed,
                                  vocab_size=self.data.vocab_size)
        self.compiled_step: Any = None
        if cfg.compile:
            from blutrain.compiler import compile as compile_step

            self.compiled_step = compile_step(self._step_body)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.val_history: list[tuple[int, float]] = []
        if cfg.resume:
            self._resume(cfg.resume)

    def _configure_precision(self) -> None:
        """fp32: strict float32 GEMMs. tf32: the backend's TF32 GEMMs (a GPU mode; a backend without it,
        like the CPU, computes float32 and says so). bf16: autocast — bf16 GEMMs and attention, float32
        norms and loss, float32 master weights and optimizer state."""
        backend = bt.device(self.device).backend
        set_tf32 = getattr(backend, "set_tf32", None)
        if set_tf32 is not None:
            set_tf32(self.cfg.dtype == "tf32")
        elif self.cfg.dtype == "tf32":
            self._print(f"note: device {self.device} has no TF32 mode; computing in float32")
        self.autocast = bt.autocast(dtype="bfloat16", enabled=self.cfg.dtype == "bf16")

    # -- state ---------------------------------------------------------------------------------
    def _rng_state(self) -> dict[str, Any]:
        dev = bt.device(self.device)
        return {str(dev): dev.backend.generator(dev.index).get_state()}

    def save(self, path: Path) -> Path:
        return save_checkpoint(
            path, model_state=self.model.state_dict(), optimizer_state=self.optimizer.state_dict(),
            trainer_state={"step": self.step, "val_history": self.val_history},
            loader_state=self.loader.state_dict(), rng_state=self._rng_state(),
            config={"train": self.cfg.to_dict(), "model": self.model_config.to_dict()})

    def _resume(self, path: str) -> None:
        state = load_checkpoint(path, device=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["trainer"]["step"])
        self.val_history = [tuple(v) for v in state["trainer"].get("val_history", [])]
        dev = bt.device(self.device)
        rng = state["rng"].get(str(dev))
        if rng is not None:
            dev.backend.generator(dev.index).set_state(rng)
        self._print(f"resumed from {path} at step {self.step}")

    # -- loop ----------------------------------------------------------------------------------
    def _batch(self, loader: TokenLoader) -> tuple[bt.Tensor, bt.Tensor]:
        x, y = loader.next_batch()
        return bt.from_numpy(x).to(self.device), bt.from_numpy(y).to(self.device)

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        return warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.lr * cfg.min_lr_ratio)

    def _step_body(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> tuple[list[bt.Tensor], bt.Tensor | None]:
        """One optimizer step on ``batches`` (the micro-batches): what ``--compile`` traces and replays.
        It ends with ``zero_grad`` so that no gradient outlives the compiled graph."""
        losses = []
        for x, y in batches:
            with self.autocast:
                _, loss = self.model(x, y)
            (loss / len(batches)).backward()
            losses.append(loss)
        norm = clip_grad_norm_(self.model.parameters(), self.cfg.clip) if self.cfg.clip > 0 else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses, norm

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.compiled_step is not None:
            self.model.train()
            batches = [self._batch(self.loader) for _ in range(cfg.grad_accum_steps)]
            losses, norm_t = self.compiled_step(batches)
            loss_mean = sum(float(loss.item()) for loss in losses) / len(losses)
            dt = time.perf_counter() - t0
            self.step += 1
            tokens = cfg.grad_accum_steps * cfg.batch_size * cfg.seq_len
            return {"step": self.step, "loss": loss_mean, "lr": lr,
                    "grad_norm": float(norm_t) if norm_t is not None else math.nan,
                    "tok_per_s": tokens / dt, "step_ms": dt * 1e3}
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        accum = cfg.grad_accum_steps
        self.model.train()
        for _ in range(accum):
            x, y = self._batch(self.loader)
            with self.autocast:
                loss = self.model(x, y)[1]  # the (B, T, vocab) logits are not kept alive through backward
            (loss / accum).backward()
            loss_sum += float(loss.item())
        norm = clip_grad_norm_(self.model.parameters(), cfg.clip) if cfg.clip > 0 else math.nan
        self.optimizer.step()
        dt = time.perf_counter() - t0
        tokens = accum * cfg.batch_size * cfg.seq_len
        self.step += 1
        return {"step": self.step, "loss": loss_sum / accum, "lr": lr, "grad_norm": float(norm),
                "tok_per_s": tokens / dt, "step_ms": dt * 1e3}

    def evaluate(self) -> float | None:
        if self.data.val_pattern is None:
            return None
        val = TokenLoader(self.data.val_pattern, self.cfg.batch_size, self.cfg.seq_len, seed=self.cfg.seed)
        self.model.eval()
        total = 0.0
        with no_grad():
            for _ in range(self.cfg.eval_batches):
                x, y = self._batch(val)
                with self.autocast:
                    _, loss = self.model(x, y)
                total += float(loss.item())
        self.model.train()
        return total / self.cfg.eval_batches

    def sample(self, prompt: str, tokens: int) -> str:
        tok = get_tokenizer(self.data.tokenizer)
        ids = tok.encode(prompt) or [tok.eot_token]
        idx = bt.tensor([ids], dtype="int64", device=self.device)
        out = self.model.generate(idx, tokens, temperature=0.8, top_k=40, seed=self.cfg.seed)
        return tok.decode(out[0].tolist())

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.toml").write_text(cfg.to_toml())
        n_params = self.model.num_parameters()
        self._print(f"BluTrain: GPT-2 '{cfg.preset}' ({n_params / 1e6:.2f} M parameters) on {self.device}, "
                    f"{cfg.optimizer}, {cfg.batch_size}×{cfg.seq_len} tokens × {cfg.grad_accum_steps} per step, "
                    f"{cfg.max_steps} steps")
        if self.data.baseline_nats is not None:
            self._print(f"data: {self.data.train_pattern} (byte-unigram entropy of val: "
                        f"{self.data.baseline_nats:.3f} nats/token — the loss to beat)")
        _emit("train_start", {"step": self.step, "config": cfg.to_dict()})
        metrics_path = self.out / "metrics.jsonl"
        mode = "a" if cfg.resume else "w"
        start = time.perf_counter()
        first_step = self.step
        with open(metrics_path, mode) as metrics:
            while self.step < cfg.max_steps:
                m = self.train_step()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                    val = self.evaluate()
                    if val is not None:
                        m["val_loss"] = val
                        self.val_history.append((self.step, val))
                        _emit("eval_end", {"step": self.step, "val_loss": val})
                metrics.write(json.dumps(m) + "\n")
                metrics.flush()
                self.history.append(m)
                _emit("step_end", dict(m))
                self._progress(m, start, first_step)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.max_steps:
                    path = self.save(self.out / f"step_{self.step:06d}.safetensors")
                    _emit("checkpoint_saved", {"step": self.step, "path": str(path)})
        if self.stream.isatty():
            self.stream.write("\n")
        final_val = self.evaluate()
        if final_val is not None:
            self.val_history.append((self.step, final_val))
            self._print(f"validation loss at step {self.step}: {final_val:.4f}")
        ckpt = self.save(self.out / "final.safetensors")
        plot = self._plot()
        result = {"step": self.step, "val_loss": final_val, "checkpoint": str(ckpt),
                  "train_loss": self.history[-1]["loss"] if self.history else None}
        _emit("train_end", result)
        return result | {"plot": str(plot) if plot else None}

    # -- output --------------------------------------------------------------------------------
    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _progress(self, m: dict[str, Any], start: float, first_step: int) -> None:
        done = self.step - first_step
        total = self.cfg.max_steps - first_step
        elapsed = time.perf_counter() - start
        eta = elapsed / max(done, 1) * (total - done)
        width = 24
        filled = int(width * self.step / self.cfg.max_steps)
        bar = "█" * filled + "·" * (width - filled)
        line = (f"[{bar}] step {self.step}/{self.cfg.max_steps}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  "
                f"{m['tok_per_s']:,.0f} tok/s  ETA {eta:4.0f}s")
        if "val_loss" in m:
            line += f"  val {m['val_loss']:.4f}"
        if self.stream.isatty():
            self.stream.write("\r" + line)
            self.stream.flush()
            if "val_loss" in m:
                self.stream.write("\n")
        elif self.step % max(self.cfg.max_steps // 20, 1) == 0 or "val_loss" in m or self.step == 1:
            self._print(line)

    def _plot(self) -> Path | None:
        from blutrain.train.plot import plot_losses

        return plot_losses(self.out / "metrics.jsonl", self.out / "loss.png", self.val_history)
