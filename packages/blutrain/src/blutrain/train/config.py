"""The trainer's typed configuration: defaults, a TOML file (``--config``), then CLI flags on top."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from blutrain.tensor.errors import BluTrainError


class ConfigError(BluTrainError, ValueError):
    """A configuration value or file is invalid; the message names the key."""


@dataclass
class TrainConfig:
    """Everything a run depends on. Field names are the CLI flags with ``-`` for ``_``."""

    preset: str = "tiny"
    data: str | None = None  # a shard directory or glob; None → the built-in stdlib corpus
    tokenizer: str = "byte"
    device: str = "auto"
    dtype: str = "fp32"
    batch_size: int = 16
    seq_len: int = 128
    total_batch_tokens: int = 0  # 0 → one micro-batch per step (no accumulation)
    max_steps: int = 450
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    warmup_steps: int = 40
    clip: float = 1.0
    eval_every: int = 150
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0 → only at the end
    out: str = "runs/latest"
    resume: str | None = None
    seed: int = 1337
    sample_tokens: int = 200
    prompt: str = "def "
    compile: bool = False  # run each step as one compiled graph (blutrain.compiler)
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "skip" the update, or "stop" the run
    keep: int = 0  # step checkpoints kept (the newest N); 0 → all
    async_checkpoint: bool = False  # stage checkpoints to host memory, write them on a background thread
    deterministic: bool = False  # deterministic kernels (e.g. the cuda embedding backward): bit-identical runs
    auto_batch: bool = False  # find the largest micro-batch that fits; accumulation keeps the global batch
    parallel: str = ""  # "MODE[=VALUE]": a registered parallel mode ("ddp", "zero=2"); "" → one process
    dist_backend: str = "auto"  # the comm backend of --parallel: "mpi", "nccl"; auto → nccl on cuda, else mpi
    model_overrides: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        positive = ("batch_size", "seq_len", "max_steps", "eval_batches")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("total_batch_tokens", "warmup_steps", "eval_every", "checkpoint_every", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in ("fp32", "tf32", "bf16"):
            raise ConfigError(f"dtype must be fp32, tf32 or bf16, got {self.dtype!r}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.on_nonfinite not in ("skip", "stop"):
            raise ConfigError(f"on_nonfinite must be 'skip' or 'stop', got {self.on_nonfinite!r}")
        if self.keep < 0:
            raise ConfigError(f"keep must be >= 0 (0 keeps every checkpoint), got {self.keep}")
        if self.compile and self.on_nonfinite == "skip":
            raise ConfigError("on_nonfinite 'skip' cannot apply to compile: the compiled step runs the optimizer "
                              "inside its graph, so a step cannot be left out after its loss is seen; use "
                              "on_nonfinite 'stop' with compile, or run eagerly")
        if self.compile and self.auto_batch:
            raise ConfigError("auto_batch cannot size compile's graph: it probes eager steps, whose memory is "
                              "not the compiled plan's; give batch_size explicitly with compile")
        self.parallel_mode()
        if self.parallel and self.compile:
            raise ConfigError(f"parallel {self.parallel!r} cannot be combined with compile: the compiled step is one "
                              "graph of this process's kernels and holds no collectives; run distributed eagerly")
        if self.parallel and self.auto_batch:
            raise ConfigError(f"auto_batch cannot be combined with parallel {self.parallel!r}: each rank would "
                              "probe its own memory and the ranks could choose different micro-batches; give "
                              "batch_size explicitly")
        micro = self.batch_size * self.seq_len
        if self.total_batch_tokens and self.total_batch_tokens % micro:
            raise ConfigError(f"total_batch_tokens ({self.total_batch_tokens}) must be a multiple of batch_size × "
                              f"seq_len ({micro})")

    def parallel_mode(self) -> tuple[str, list[int | float | str]] | None:
        """``parallel`` parsed: ``"zero=2"`` → ``("zero", [2])``, ``"ddp"`` → ``("ddp", [])``, ``""`` → None. The
        value is the mode's first option (zero: the stage; ddp: the bucket size in MiB)."""
        if not self.parallel:
            return None
        name, sep, raw = self.parallel.partition("=")
        if not name.isidentifier() or (sep and not raw) or "," in raw:
            raise ConfigError(f"parallel must be MODE or MODE=VALUE (e.g. 'ddp', 'zero=2'), got {self.parallel!r}")
        if not sep:
            return name, []
        value: int | float | str
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
        return name, [value]

    @property
    def grad_accum_steps(self) -> int:
        return max(self.total_batch_tokens // (self.batch_size * self.seq_len), 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_toml(self) -> str:
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{f.name} = {{ {inner} }}")
            else:
                lines.append(f"{f.name} = {json.dumps(value)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> TrainConfig:
        known = {f.name: f for f in fields(cls)}
        cfg = cls()
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
            default = getattr(cfg, name)
            if default is not None and not isinstance(value, type(default)) and not (
                    isinstance(default, float) and isinstance(value, int)):
                raise ConfigError(f"{source}: {key} must be {type(default).__name__}, got {value!r}")
            setattr(cfg, name, float(value) if isinstance(default, float) else value)
        return cfg

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        p = Path(path)
        try:
            values = tomllib.loads(p.read_text())
        except OSError as exc:
            raise ConfigError(f"--config {p}: cannot read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {p}: invalid TOML: {exc}") from None
        return cls.from_dict(values, str(p))
