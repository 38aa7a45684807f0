"""The trainer's typed configuration: defaults, a TOML file (``--config``), then CLI flags on top."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blutrain.data.tokenizer import TOKENIZER_NAMES
from blutrain.tensor.errors import BluTrainError

if TYPE_CHECKING:
    from blutrain.dist import ParallelMode


class ConfigError(BluTrainError, ValueError):
    """A configuration value or file is invalid; the message names the key."""


def installed_modes() -> dict[str, type[ParallelMode]]:
    """Every installed parallel mode, name → class."""
    from blutrain.dist import parallel_modes

    return dict(parallel_modes().items())


def mesh_modes(modes: dict[str, type[ParallelMode]]) -> dict[str, str]:
    """Mesh dimension → the name of the mode the mesh form applies along it (the modes that declare
    ``on_mesh``), dimensions outermost first (their ``mesh_order``)."""
    found: dict[str, str] = {}
    for name, cls in modes.items():
        if cls.on_mesh:
            if cls.dim in found:
                raise ConfigError(f"parallel: modes {found[cls.dim]!r} and {name!r} both declare on_mesh for the "
                                  f"dimension {cls.dim!r}; block one with BLUTRAIN_DISABLE_PLUGINS")
            found[cls.dim] = name
    return dict(sorted(found.items(), key=lambda item: modes[item[1]].mesh_order))


@dataclass(frozen=True)
class ParallelPlan:
    """``--parallel`` parsed: how the ranks of a run are laid out and what wraps the model.

    Two forms. ``MODE[=VALUE][,KEY=VALUE...]`` (``ddp``, ``ddp=25``, ``zero=2``, ``ddp,grad_dtype=bf16``, any
    registered mode): the mode over every rank, VALUE its first option, the KEY=VALUE pairs its keyword
    options; ``mesh`` is empty. Mesh sizes (``dp=2,tp=2``, ``dp=2,cp=2,attn=ring``, ``tp=4``, ``tp=2,async=4``,
    ``cp=2``, ``dp=4``): a :class:`blutrain.dist.DeviceMesh` of those dimensions, whose sizes multiply to the
    number of ranks, each dimension run by the installed mode that declares ``on_mesh`` for it, and the other
    keys the options those modes declare (``mesh_options``); the inner dimensions' modes wrap the model first.
    A mode that declares ``on_mesh_by_name`` runs along its dimension in place of that dimension's ``on_mesh``
    mode when the mesh names it, ``NAME[=VALUE]`` with VALUE its first option (``dp=2,tp=2,zero=1``).
    ``modes``: (name, positional options, keyword options), innermost first.
    """

    text: str
    mesh: dict[str, int]
    modes: tuple[tuple[str, tuple[int | float | str, ...], dict[str, int | float | str]], ...]

    def size(self, dim: str) -> int:
        """The mesh's size along ``dim`` (1 where the mesh has no such dimension)."""
        return self.mesh.get(dim, 1)

    @property
    def ranks(self) -> int | None:
        """The number of ranks the mesh lays out (None: a mode over however many there are)."""
        return math.prod(self.mesh.values()) if self.mesh else None


def _signature(cls: type[ParallelMode]) -> str:
    """The options a mode's ``check_options`` takes, as ``(stage=2, bucket_cap_mb=25.0)``."""
    import inspect

    try:
        params = inspect.signature(cls.check_options).parameters.values()
    except (TypeError, ValueError):
        return "(...)"
    return "(" + ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params) + ")"


def _option(raw: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


@dataclass
class TrainConfig:
    """Everything a run depends on. Field names are the CLI flags with ``-`` for ``_``."""

    model: str = "gpt2"  # a registered model family (see `blutrain plugins`)
    preset: str | None = None  # None → "tiny", or with init_from the architecture of its config.json
    init_from: str | None = None  # a Hugging Face GPT-2 directory (config.json, model.safetensors): initial weights
    data: str | None = None  # a shard directory or glob; None → the built-in stdlib corpus
    tokenizer: str | None = None  # "byte" or "gpt2"; None → what the data records (byte for the built-in corpus)
    tokenizer_file: str | None = None  # gpt2's .tiktoken ranks file; None → the dataset's, else tiktoken's cache
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
    out: str = ""  # "" → a fresh runs/<YYYYmmdd-HHMMSS> (runs/latest links to it), or the resumed checkpoint's
    overwrite: bool = False  # replace the run already in out (its files are deleted first); never saved in config.toml
    resume: str | None = None
    seed: int = 1337
    sample_tokens: int = 200
    prompt: str = "def "
    compile: bool = False  # run each step as one compiled graph (blutrain.compiler)
    # with compile: make cheap forward values (SwiGLU and norm outputs, bf16 weight copies) again before their
    # backward readers instead of holding them (the compiler's rematerialize pass): less memory for a pass over
    # them; None: the compiler's default pipeline
    remat: bool | None = None
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "skip" the update, or "stop" the run
    keep: int = 3  # step checkpoints kept (the newest N); 0 → all
    async_checkpoint: bool = False  # stage checkpoints to host memory, write them on a background thread
    deterministic: bool = False  # deterministic kernels (e.g. the cuda embedding backward): bit-identical runs
    auto_batch: bool = False  # find the largest micro-batch that fits; accumulation keeps the global batch
    parallel: str = ""  # "MODE[=VALUE]" ("ddp", "zero=2") or a mesh ("dp=2,tp=2", "dp=2,tp=2,zero=1"); "" → one process
    dist_backend: str = "auto"  # the comm backend of --parallel ("mpi", "nccl"); auto: the device's declared one
    log: list[str] = field(default_factory=list)  # loggers of the training events, by plugin name: csv, tensorboard
    model_overrides: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("preset", "init_from", "tokenizer", "tokenizer_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {value!r}")
        known = self.tokenizer in TOKENIZER_NAMES or str(self.tokenizer).startswith("hf:")
        if self.tokenizer is not None and not known:
            raise ConfigError(f"tokenizer must be one of {', '.join(TOKENIZER_NAMES)} or hf:PATH (a Hugging Face "
                              f"tokenizer.json), got {self.tokenizer!r}; leave it out to use the tokenizer the data "
                              "was prepared with")
        if self.init_from is not None and self.resume is not None:
            raise ConfigError(f"init_from {self.init_from!r} and resume {self.resume!r} both set the weights; give "
                              "resume to continue a run, or init_from to start a new one from pretrained weights")
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
        if any(not isinstance(name, str) or not name for name in self.log):
            raise ConfigError(f"log must be a list of logger names such as ['csv', 'tensorboard'], got {self.log!r}")
        if self.keep < 0:
            raise ConfigError(f"keep must be >= 0 (0 keeps every checkpoint), got {self.keep}")
        if self.compile and self.on_nonfinite == "skip":
            raise ConfigError("on_nonfinite 'skip' cannot apply to compile: the compiled step runs the optimizer "
                              "inside its graph, so a step cannot be left out after its loss is seen; use "
                              "on_nonfinite 'stop' with compile, or run eagerly")
        if self.remat is not None and not isinstance(self.remat, bool):
            raise ConfigError(f"remat must be true or false, got {self.remat!r}")
        if self.remat and not self.compile:
            raise ConfigError("remat recomputes values inside the compiled step: add compile (--compile), or leave "
                              "out remat")
        if self.compile and self.auto_batch:
            raise ConfigError("auto_batch cannot size compile's graph: it probes eager steps, whose memory is "
                              "not the compiled plan's; give batch_size explicitly with compile")
        plan = self.parallel_plan()
        if plan is not None:
            self._check_modes(plan)
        if self.parallel and self.auto_batch:
            raise ConfigError(f"auto_batch cannot be combined with parallel {self.parallel!r}: each rank would "
                              "probe its own memory and the ranks could choose different micro-batches; give "
                              "batch_size explicitly")
        micro = self.batch_size * self.seq_len
        if self.total_batch_tokens and self.total_batch_tokens % micro:
            raise ConfigError(f"total_batch_tokens ({self.total_batch_tokens}) must be a multiple of batch_size × "
                              f"seq_len ({micro})")

    def _check_modes(self, plan: ParallelPlan) -> None:
        """What each mode of ``plan`` declares, checked before any rank starts work: its options
        (``check_options``), the sequence length it can cut (``sequence_multiple`` of its mesh size) and, with
        compile, ``compiles = True`` (its collectives go through groups made by ``blutrain.dist.traceable``, which
        the compiled step records). A mode that is not installed is left to the trainer, which names what is."""
        from blutrain.dist import DistArgumentError

        modes = installed_modes()
        for name, args, options in plan.modes:
            cls = modes.get(name)
            if cls is None:
                continue
            try:
                cls.check_options(*args, **options)
            except DistArgumentError as exc:
                raise ConfigError(f"parallel {self.parallel!r}: {exc}") from None
            except TypeError:  # an option the mode's signature does not have
                given = ", ".join([*map(repr, args), *(f"{k}={v}" for k, v in options.items())])
                raise ConfigError(f"parallel {self.parallel!r}: mode {name!r} does not take the options {given}; "
                                  f"it takes {_signature(cls)}: give those, or leave the others out") from None
            multiple = cls.sequence_multiple(plan.size(cls.dim)) if cls.dim in plan.mesh else 1
            if self.seq_len % multiple:
                raise ConfigError(f"seq_len must be a multiple of {multiple} under parallel {self.parallel!r} (mode "
                                  f"{name!r} over {cls.dim}={plan.size(cls.dim)} cuts every sequence so), got "
                                  f"{self.seq_len}")
            if self.compile and not cls.compiles:
                compiling = ", ".join(n for n, c in modes.items() if c.compiles) or "none installed"
                raise ConfigError(f"parallel {self.parallel!r} cannot be combined with compile: mode {name!r} has "
                                  "not declared how it composes with the compiler: it does not set compiles = True "
                                  "on its class, so its collectives are not declared with blutrain.dist.traceable "
                                  "and tracing would refuse the first of them. Run it eagerly, or compile with a "
                                  f"mode that declares it ({compiling})")

    def parallel_plan(self) -> ParallelPlan | None:
        """``parallel`` parsed (None when it is empty); see :class:`ParallelPlan` for the forms."""
        if not self.parallel:
            return None
        text = self.parallel
        form = (f"parallel must be MODE[=VALUE] ('ddp', 'zero=2', 'ddp,grad_dtype=bf16') or mesh sizes "
                f"('dp=2,tp=2', 'dp=2,cp=2,attn=ulysses', 'tp=4', 'dp=2,tp=2,zero=1'), got {text!r}")
        parts: list[tuple[str, str | None]] = []
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            if not key.isidentifier() or (sep and not value):
                raise ConfigError(form)
            if key in (k for k, _ in parts):
                raise ConfigError(f"parallel {text!r}: {key} is given twice")
            parts.append((key, value if sep else None))
        modes = installed_modes()
        on_mesh = mesh_modes(modes)
        # modes a mesh runs along their dimension when named (dp=2,tp=2,zero=1), in place of the on_mesh mode
        by_name = {name: cls for name, cls in modes.items() if cls.on_mesh_by_name and not cls.on_mesh}
        dims = {*on_mesh, *(cls.dim for cls in by_name.values())}
        if not any(key in dims for key, _ in parts):
            name, given = parts[0]
            keywords: dict[str, int | float | str] = {}
            for key, raw in parts[1:]:  # MODE[=VALUE],key=value,...: the mode's keyword options
                if raw is None:
                    raise ConfigError(f"parallel {text!r}: {key!r} after the mode must be key=value (e.g. "
                                      f"'{name},grad_dtype=bf16')")
                keywords[key] = _option(raw)
            return ParallelPlan(text, {}, ((name, () if given is None else (_option(given),), keywords),))
        # the dimension → mode of this mesh: the on_mesh ones, replaced where a mode is named
        chosen = dict(on_mesh)
        named: dict[str, str] = {}  # dimension → the named mode's part as given
        first: dict[str, tuple[int | float | str, ...]] = {}
        for key, raw in parts:
            if key in by_name:
                dim = by_name[key].dim
                part = key if raw is None else f"{key}={raw}"
                if dim in named:
                    raise ConfigError(f"parallel {text!r}: {named[dim]} and {part} both run along {dim}; a dimension "
                                      "takes one mode, give one of them")
                named[dim] = part
                chosen[dim] = key
                first[dim] = () if raw is None else (_option(raw),)
        order = {dim: modes[name].mesh_order for dim, name in chosen.items()}
        chosen = dict(sorted(chosen.items(), key=lambda item: order[item[0]]))
        # the mesh form's option keys: key → (dimension, the keyword of that dimension's mode)
        option_keys = {key: (dim, keyword) for dim, name in chosen.items()
                       for key, keyword in modes[name].mesh_options.items()}
        replaced = {key: (dim, on_mesh[dim]) for dim in named if dim in on_mesh
                    for key in modes[on_mesh[dim]].mesh_options if key not in option_keys}
        sizes: dict[str, int] = {}
        options: dict[str, dict[str, int | float | str]] = {dim: {} for dim in chosen}
        for key, raw in parts:
            if key in dims:
                if raw is None or not raw.isdigit() or int(raw) < 1:
                    raise ConfigError(f"parallel {text!r}: {key} must be a number of ranks >= 1 (e.g. {key}=2), "
                                      f"got {'no size' if raw is None else repr(raw)}")
                sizes[key] = int(raw)
            elif key in by_name:
                continue
            elif key in option_keys and raw is not None:
                dim, keyword = option_keys[key]
                options[dim][keyword] = _option(raw)
            elif key in replaced:
                dim, name = replaced[key]
                raise ConfigError(f"parallel {text!r}: {key}= is an option of mode {name!r}, which {named[dim]} "
                                  f"replaces along {dim}; leave {key}= out, or give {dim}=N without {named[dim]}")
            elif key in modes and modes[key].on_mesh:
                raise ConfigError(f"parallel {text!r}: in a mesh, mode {key} runs along {modes[key].dim}: give "
                                  f"{modes[key].dim}=N instead of {key}")
            elif key in modes:
                alone = key if raw is None else f"{key}={raw}"
                sized = ", ".join(f"{dim}=N" for dim in chosen)
                raise ConfigError(f"parallel {text!r}: mode {key} does not compose with a mesh (it declares neither "
                                  f"on_mesh nor on_mesh_by_name): it runs alone over every rank; give {alone} alone, "
                                  f"or mesh sizes ({sized})")
            else:
                part = key if raw is None else f"{key}={raw}"
                keys = ", ".join(f"{k}= (with {dim}=N)" for k, (dim, _) in option_keys.items())
                alternatives = ", ".join(f"{name}[=VALUE] (along {cls.dim})" for name, cls in by_name.items())
                raise ConfigError(f"parallel {text!r}: unknown part {part!r}; a mesh takes "
                                  f"{', '.join(f'{dim}=N' for dim in chosen)}"
                                  + (f", the options {keys}" if keys else "")
                                  + (f" and the modes {alternatives}" if alternatives else ""))
        for dim in sizes:
            if dim not in chosen:
                names = ", ".join(f"{name}[=VALUE]" for name, cls in by_name.items() if cls.dim == dim)
                raise ConfigError(f"parallel {text!r}: no installed mode runs along {dim} unless named; give one "
                                  f"beside {dim}={sizes[dim]}: {names}")
        for dim, part in named.items():
            if dim not in sizes:
                raise ConfigError(f"parallel {text!r}: {part} runs along {dim}, which the mesh does not size; give "
                                  f"{dim}=N beside it (e.g. '{dim}=2,{part}')")
        for key, (dim, _) in option_keys.items():
            given = dict(parts).get(key)
            if given is not None and dim not in sizes:
                raise ConfigError(f"parallel {text!r}: {key}={given} is an option of mode {chosen[dim]!r} and "
                                  f"needs {dim}=N")
        mesh = {dim: sizes[dim] for dim in chosen if dim in sizes}
        # layer-rewriting modes wrap each other innermost first; each but the innermost must take a rewritten model
        rewriting = [chosen[dim] for dim in mesh if modes[chosen[dim]].rewrites_layers]
        refusing = [name for name in rewriting[:-1] if not modes[name].wraps_rewritten]
        if refusing:
            raise ConfigError(f"parallel {text!r}: {' and '.join(rewriting)} do not compose ({refusing[0]} rewrites "
                              f"the model's layers and cannot wrap a model {rewriting[-1]} rewrote: it does not "
                              "declare wraps_rewritten); give one of them, alone or with the other dimensions")
        plan_modes = tuple((chosen[dim], first.get(dim, ()), options[dim]) for dim in reversed(mesh))
        return ParallelPlan(text, mesh, plan_modes)

    @property
    def grad_accum_steps(self) -> int:
        return max(self.total_batch_tokens // (self.batch_size * self.seq_len), 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_toml(self) -> str:
        """The configuration as TOML (a run's config.toml). ``overwrite`` is left out: running a saved
        configuration again must never delete the run it came from."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "overwrite":
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
