"""The training loop: data, model, optimizer plugin, schedule, clipping, evaluation, checkpoints.

One step = ``grad_accum_steps`` micro-batches of forward + backward, one clip, one optimizer step.
With ``--parallel`` each rank of ``blutrain run`` trains its slice of every batch through the modes
(:class:`blutrain.dist.ParallelMode`); losses are averaged over ranks and only rank 0 logs and writes (under a
mode that shards state, every rank of that mode's group writes its shard of each checkpoint). The trainer reads
what a mode, the optimizer and the backend declare, and names none of them.
Everything that decides the numbers (model weights, optimizer state, loader position, RNG states,
step) is in the checkpoint, so a resumed CPU run reproduces an uninterrupted one bit for bit.
The device should not wait on the host between steps. Once a step's work is launched, and before its loss is
read back (the step's one host sync), the host draws the next step's batches and copies them to the device
(the loader position a checkpoint saves is the one before those: :meth:`Trainer.loader_state`), and does the
previous step's bookkeeping that no launch needs: its metrics.jsonl row, its ``step_end`` event and its
progress line. That bookkeeping is deferred only when the loop goes straight on to the next step; a step
that evaluates, checkpoints, stops or is the last is recorded at once, and a deferred row is written before
the run ends in any way (an error, a second Ctrl-C), so that every step's row is written, in order.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.data import (
    LoaderError,
    Tokenizer,
    TokenizerUnavailableError,
    TokenLoader,
    get_tokenizer,
    stdlib_corpus,
)
from blutrain.data.prepare import PrepareReport
from blutrain.dist import DistEnv, ParallelMode
from blutrain.models import ModelError, model_spec
from blutrain.optim import clip_grad_norm_, optimizers, warmup_cosine, weight_decay_groups
from blutrain.tensor.errors import BluTrainError
from blutrain.train.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    StagedCheckpoint,
    remove_stale_temporaries,
    rotate_checkpoints,
    stage_checkpoint,
    step_checkpoints,
    write_checkpoint,
)
from blutrain.train.config import ConfigError, TrainConfig
from blutrain.train.errors import NonFiniteError, TrainInterruptedError, TrainOutOfMemoryError, step_out_of_memory
from blutrain.train.interrupt import StopSignals, signal_name
from blutrain.train.loggers import check_loggers, train_event_hook
from blutrain.train.model_source import load_initial_weights, model_config
from blutrain.train.run_directory import (
    MetricsLog,
    check_run_directory,
    default_run_directory,
    point_latest,
    prepare_run_directory,
)
from blutrain.train.sharded import (
    load_any_checkpoint,
    remove_orphan_shards,
    save_sharded_checkpoint,
    stage_sharded_checkpoint,
)
from blutrain.train.throughput import Throughput


def resolve_device(name: str) -> str:
    """``auto`` → the first available accelerator (``blutrain.tensor.default_device``: cuda where a CUDA backend
    is installed and sees a GPU), else cpu. A named device must be
    usable here: an installed backend that cannot run (no GPU, no CuPy) is a ConfigError saying why."""
    if name != "auto":
        try:
            dev = bt.device(name)  # validates against installed backends
        except BluTrainError as exc:
            raise ConfigError(f"device {name!r}: {exc}") from None
        if not dev.backend.is_available():
            try:  # the backend's own reason (e.g. which package to install), from touching the device
                bt.zeros(1, device=dev)
            except BluTrainError as exc:
                raise ConfigError(f"device {name!r} cannot be used here: {exc}; or train with --device cpu") from None
            raise ConfigError(f"device {name!r}: its backend reports no available device; train with --device cpu")
        return name
    return bt.default_device()


def rank_device(name: str, env: DistEnv) -> str:
    """The device of this rank: an accelerator named without an index (``cuda``) gets the rank's local index
    among several ranks (``cuda:1``), so that every rank of a node has a device of its own; an indexed name, a
    single process and the CPU are left as they are."""
    if env.world_size > 1 and ":" not in name and bt.backends().get(name).accelerator:
        return f"{name}:{env.local_rank}"
    return name


@dataclass
class Dataset:
    train_pattern: str
    val_pattern: str | None  # None: no validation split (a glob, or prepared with val_fraction 0)
    vocab_size: int
    tokenizer: str
    baseline_nats: float | None
    tokenizer_file: str | None = None  # gpt2's ranks file; None: byte, or tiktoken's cache


def resolve_data(cfg: TrainConfig) -> Dataset:
    """The data ``cfg`` names and its tokenizer: a prepared directory records its own (a ``tokenizer``
    given as well must agree), the built-in corpus is byte-level, a glob's is ``tokenizer`` (byte by
    default). ``tokenizer_file`` overrides the ranks file the dataset records."""
    if cfg.data is None:
        if cfg.tokenizer not in (None, "byte") or cfg.tokenizer_file is not None:
            given = f"tokenizer {cfg.tokenizer!r}" if cfg.tokenizer not in (None, "byte") else "tokenizer_file"
            raise ConfigError(f"{given} does not apply to the built-in corpus, which is byte-tokenized; to train on "
                              "GPT-2 tokens, tokenize text with `blutrain prepare FILES --out DIR --tokenizer gpt2 "
                              "--val-fraction 0.1` and give --data DIR")
        report = stdlib_corpus()
        return Dataset(report.train_pattern, report.val_pattern, report.vocab_size, "byte",
                       report.val_entropy_nats)
    path = Path(cfg.data)
    if path.is_dir() and (path / "dataset.json").exists():
        report = PrepareReport.read(path)
        if cfg.tokenizer is not None and cfg.tokenizer != report.tokenizer:
            raise ConfigError(f"tokenizer {cfg.tokenizer!r} disagrees with {path / 'dataset.json'}: the data was "
                              f"prepared with {report.tokenizer!r}; leave --tokenizer out (the dataset records it)")
        if cfg.tokenizer_file is not None and report.tokenizer == "byte":
            raise ConfigError(f"tokenizer_file {cfg.tokenizer_file!r} does not apply to {path}: it was prepared with "
                              "the byte tokenizer, which reads no file; leave --tokenizer-file out")
        return Dataset(report.train_pattern, report.val_pattern if report.val_shards else None, report.vocab_size,
                       report.tokenizer, report.val_entropy_nats, cfg.tokenizer_file or report.tokenizer_file)
    tokenizer = cfg.tokenizer or "byte"
    # GPT-2's 50257 without reading its ranks file; a Hugging Face tokenizer.json says its own
    vocab = {"byte": 256, "gpt2": 50257}.get(tokenizer) or get_tokenizer(tokenizer).vocab_size
    return Dataset(str(path), None, vocab, tokenizer, None, cfg.tokenizer_file)


def _emit(event: str, state: dict[str, Any]) -> None:
    hook = train_event_hook()
    if hook.get_hookimpls():
        hook(event=event, state=state)


def _host_tree(value: Any) -> Any:
    """A copy of a state tree with every tensor copied to the CPU (what a probe must restore)."""
    if isinstance(value, bt.Tensor):
        return value.detach().to(device="cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_tree(v) for v in value)
    return value


def smaller_micro_batch(global_batch: int, micro_batch: int) -> int:
    """The largest divisor of ``global_batch`` that is at most half of ``micro_batch`` (0 when there is
    none): the next micro-batch ``--auto-batch`` tries after ``micro_batch`` ran out of memory."""
    return max((d for d in range(1, micro_batch // 2 + 1) if global_batch % d == 0), default=0)


class Trainer:
    """Trains the model family ``TrainConfig.model`` names as ``TrainConfig`` says; ``run()`` returns the final
    metrics."""

    def __init__(self, cfg: TrainConfig, stream: TextIO | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.plan = cfg.parallel_plan()
        self.group: Any = self._init_distributed()
        self.rank: int = self.group.rank if self.group is not None else 0
        self.world: int = self.group.size if self.group is not None else 1
        self.mesh: Any = None
        # the data-parallel rank and size: over the mesh dimensions whose modes split the batch (splits_batch);
        # ranks that differ only along the others train on the same rows
        self.dp_rank, self.dp_size = self.rank, self.world
        if self.plan is not None and self.plan.mesh:
            from blutrain.dist import DeviceMesh, parallel_modes

            self.mesh = DeviceMesh(self.group, self.plan.mesh)
            on_dim = {cls.dim: cls for cls in (parallel_modes().get(name) for name, _, _ in self.plan.modes)}
            self.dp_rank, self.dp_size = 0, 1
            for dim in self.plan.mesh:  # outermost first
                if on_dim[dim].splits_batch:
                    self.dp_rank = self.dp_rank * self.mesh.size(dim) + self.mesh.local_rank(dim)
                    self.dp_size *= self.mesh.size(dim)
        self.stream = (stream or sys.stdout) if self.rank == 0 else open(os.devnull, "w")  # noqa: SIM115
        # the run directory: checked before anything is built; created (and with --overwrite emptied) by run()
        self.default_out = not cfg.out
        if self.default_out:
            cfg.out = str(Path(os.path.realpath(cfg.resume)).parent if cfg.resume
                          else default_run_directory(self.world))
        self.out = Path(cfg.out)
        check_run_directory(self.out, resuming=bool(cfg.resume), overwrite=cfg.overwrite)
        micro = cfg.batch_size * cfg.seq_len * self.dp_size
        if cfg.total_batch_tokens and cfg.total_batch_tokens % micro:
            raise ConfigError(f"total_batch_tokens ({cfg.total_batch_tokens}) must be a multiple of batch_size × "
                              f"seq_len × data-parallel ranks ({cfg.batch_size} × {cfg.seq_len} × {self.dp_size} "
                              f"= {micro})")
        self.accum = max(cfg.total_batch_tokens // micro, 1)
        self._configure_precision()
        check_loggers(cfg.log)
        bt.manual_seed(cfg.seed)
        self.data = resolve_data(cfg)
        self.tokenizer, self.tokenizer_problem = self._load_tokenizer()
        self.model_spec = self._model_spec()
        self.model_config = model_config(cfg, self.data.vocab_size, self.model_spec)
        if cfg.seq_len > self.model_config.block_size:
            raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's block_size {self.model_config.block_size}")
        if self.data.vocab_size > self.model_config.vocab_size:
            raise ConfigError(f"the data's vocabulary ({self.data.vocab_size}) is larger than the model's "
                              f"({self.model_config.vocab_size})")
        self.net = self.model_spec.build(self.model_config).to(self.device)  # self.model is what trains it
        if cfg.init_from is not None:
            load_initial_weights(self.net, cfg)
        elif cfg.preset is None:
            cfg.preset = self.model_spec.default_preset
        dev = bt.device(self.device)
        self.throughput = Throughput.for_run(self.net.flops_per_token(cfg.seq_len), dev.backend, dev.index, cfg.dtype,
                                             self.world)
        self.n_params = self.net.num_parameters()
        self.modes: list[ParallelMode] = self._parallel_modes()  # innermost first
        self.model: Any = self.net
        for i, mode in enumerate(self.modes):  # a mode may rewrite self.net in place: the optimizer is built over
            if mode.nests_state and self.mesh is not None:  # what it leaves
                self._nest(mode, self.modes[:i])
            self.model = self._configured(mode.wrap_model, self.model)
        # the loss without the [B, T, vocab] logits (the fused head and loss of the model's forward); a mode that
        # computes its own loss from sharded logits takes no such option
        shards_loss = any(mode.shards_loss for mode in self.modes)
        self.loss_options: dict[str, Any] = {} if shards_loss else {"return_logits": False}
        groups = weight_decay_groups(self.net.parameters(), cfg.weight_decay)
        optimizer_class: Any = optimizers().get(cfg.optimizer)  # an unknown name lists the installed ones
        self.optimizer: Any = optimizer_class(groups, **{**optimizer_class.trainer_defaults, "lr": cfg.lr})
        for mode in self.modes:
            self.optimizer = self._configured(mode.wrap_optimizer, self.optimizer)
        outermost_first = self.modes[::-1]
        # the mode that knows the global gradient norm where no rank holds every whole gradient; None → the
        # norm of the local (whole) gradients
        self.norm_source: ParallelMode | None = next((m for m in outermost_first if m.shards_gradients), None)
        # the mode whose ranks hold parts of the state: it writes sharded checkpoints, gathers whole state and
        # loads whole state into its parts; None → every rank holds the whole state
        self.state_owner: ParallelMode | None = next((m for m in outermost_first if m.shards_state), None)
        self.sharded = self.state_owner is not None
        self.step = 0
        self._signals: StopSignals | None = None  # while run() trains: SIGINT/SIGTERM stop at a step boundary
        self._agreed_stop: int | None = None
        self.skipped_steps: list[int] = []
        self.history: list[dict[str, Any]] = []
        self.val_history: list[tuple[int, float]] = []
        # built before the batch search, so that a bad shard is reported before any probe runs
        self.loader = self._make_loader()
        # the next step's batches, drawn and on the device while this step runs there, and the loader's state
        # before them (what a checkpoint saves): see _prefetch
        self._prefetched: tuple[dict[str, Any], list[tuple[bt.Tensor, bt.Tensor]]] | None = None
        # run()'s bookkeeping of the step before, done by the next step once it is launched: see _run_deferred
        self._deferred: Callable[[], None] | None = None
        resume = load_any_checkpoint(cfg.resume, device=self.device) if cfg.resume else None
        if cfg.auto_batch:
            self._choose_micro_batch(resume)
        self.compiled_step: Any = None
        if cfg.compile:
            from blutrain.compiler import compile as compile_step

            self.compiled_step = compile_step(self._step_body, remat=cfg.remat)
            if self.group is not None:  # its graphs will capture the group's collectives
                from blutrain.dist import before_destroy

                before_destroy(self.release_compiled)
        self.writer = CheckpointWriter() if cfg.async_checkpoint and self._writes_a_file() else None
        if resume is not None:
            self._resume(cfg.resume or "", resume)

    def _model_spec(self) -> Any:
        """The family ``--model`` names; an unknown name is a ConfigError listing the installed ones."""
        try:
            return model_spec(self.cfg.model)
        except (LookupError, ModelError) as exc:
            raise ConfigError(f"model: {exc}; see `blutrain plugins`") from None

    def _load_tokenizer(self) -> tuple[Tokenizer | None, str | None]:
        """The data's tokenizer, for the sample at the end, and the run's config set to it, so that
        config.toml and every checkpoint record what ``blutrain generate`` must read. A ranks file the user
        named that cannot be read is an error; a missing default one (tiktoken's cache) only costs the
        sample, since the shards are tokenized already: (None, why)."""
        named = self.cfg.tokenizer_file
        self.cfg.tokenizer = self.data.tokenizer
        self.cfg.tokenizer_file = (None if self.data.tokenizer_file is None
                                   else str(Path(self.data.tokenizer_file).resolve()))
        try:
            return get_tokenizer(self.data.tokenizer, self.cfg.tokenizer_file), None
        except TokenizerUnavailableError as exc:
            if named is not None:
                raise ConfigError(f"tokenizer_file: {exc}") from None
            return None, str(exc)

    def _make_loader(self) -> TokenLoader:
        return TokenLoader(self.data.train_pattern, self.cfg.batch_size, self.cfg.seq_len, seed=self.cfg.seed,
                           vocab_size=self.data.vocab_size, rank=self.dp_rank, world_size=self.dp_size)

    # -- distribution --------------------------------------------------------------------------
    def _init_distributed(self) -> Any:
        """``--parallel``: this rank's default process group (made here unless the caller made one).
        Without it, a launch of several ranks is an error rather than N copies of one run."""
        from blutrain import dist

        world = dist.get_world_size() if dist.is_initialized() else dist.detect().world_size
        if self.plan is None:
            if world > 1:
                raise ConfigError(f"this process is one of {world} ranks but parallel is not set: every rank would "
                                  "train the same model alone; give --parallel ddp, zero=STAGE or mesh sizes such as "
                                  f"dp={world}")
            return None
        if self.plan.ranks is not None and self.plan.ranks != world:
            sizes = " × ".join(f"{dim} {n}" for dim, n in self.plan.mesh.items())
            raise ConfigError(f"parallel {self.plan.text!r} lays out {self.plan.ranks} ranks ({sizes}), but this run "
                              f"has {world} rank(s); launch `blutrain run -n {self.plan.ranks}` or give sizes that "
                              f"multiply to {world}")
        # also in a group made before this trainer (a second trainer in the process, or the caller's group)
        self.device = rank_device(self.device, dist.detect())
        if dist.is_initialized():
            return dist.get_process_group()
        backend = self.cfg.dist_backend
        if backend == "auto":
            backend = dist.default_comm_backend(self.device)
        return dist.init_process_group(backend)

    def _parallel_modes(self) -> list[ParallelMode]:
        """The modes of ``--parallel``, innermost first, each made over the mesh (or the whole group)."""
        if self.plan is None:
            return []
        from blutrain import dist

        modes = []
        for name, args, options in self.plan.modes:
            try:
                cls = dist.parallel_modes().get(name)
            except LookupError as exc:
                raise ConfigError(f"parallel {self.plan.text!r}: {exc}") from None
            try:
                modes.append(cls(self.mesh if self.mesh is not None else self.group, *args, **options))
            except TypeError as exc:
                raise ConfigError(f"parallel {self.plan.text!r}: mode {name!r} does not take {[*args]} {options}: "
                                  f"{exc}") from None
            except dist.DistArgumentError as exc:
                raise ConfigError(f"parallel {self.plan.text!r}: {exc}") from None
        return modes

    def _nest(self, mode: ParallelMode, inner_modes: list[ParallelMode]) -> None:
        """Tell ``mode`` (``nests_state``) where each rank's tensors sit before it wraps the model: ``net`` as the
        inner modes left it, and the outermost of them that shards state (None: every tensor is whole)."""
        inner = next((m for m in reversed(inner_modes) if m.shards_state), None)
        self._configured(lambda net: mode.nest(net, inner), self.net)

    def _configured(self, wrap: Any, target: Any) -> Any:
        """``wrap(target)``, a mode's refusal (e.g. heads not divisible by its group) reported as a ConfigError."""
        from blutrain.dist import DistArgumentError

        try:
            return wrap(target)
        except DistArgumentError as exc:
            raise ConfigError(f"parallel {self.cfg.parallel!r}: {exc}") from None

    def _configure_precision(self) -> None:
        """fp32: strict float32 GEMMs. tf32: the backend's TF32 GEMMs (a GPU mode; a backend without it,
        like the CPU, computes float32 and says so). bf16: autocast — bf16 GEMMs and attention, float32
        norms and loss, float32 master weights and optimizer state. ``--deterministic``: the backend's
        deterministic kernels, where it has faster non-deterministic ones."""
        backend = bt.device(self.device).backend
        if not backend.set_tf32(self.cfg.dtype == "tf32") and self.cfg.dtype == "tf32":
            self._print(f"note: device {self.device} has no TF32 mode; computing in float32")
        if self.cfg.deterministic:
            backend.set_deterministic(True)
        self.autocast = bt.autocast(dtype="bfloat16", enabled=self.cfg.dtype == "bf16")

    # -- state ---------------------------------------------------------------------------------
    def _rng_state(self) -> dict[str, Any]:
        dev = bt.device(self.device)
        return {str(dev): dev.backend.generator(dev.index).get_state()}

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        dev = bt.device(self.device)
        rng = state.get(str(dev))
        if rng is not None:
            dev.backend.generator(dev.index).set_state(rng)

    def _whole_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The single-process model and optimizer state dicts, where every rank holds the whole state (a
        sharded state is saved as shards)."""
        return self.net.state_dict(), self.optimizer.state_dict()

    def _run_state(self, loader_state: dict[str, Any] | None = None,
                   rng_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything a checkpoint holds besides the model and optimizer state."""
        return {"trainer_state": {"step": self.step, "val_history": self.val_history,
                                  "skipped_steps": self.skipped_steps},
                "loader_state": loader_state if loader_state is not None else self.loader_state(),
                "rng_state": rng_state if rng_state is not None else self._rng_state(),
                "config": {"train": self.cfg.to_dict(), "model": self.model_config.to_dict()}}

    def _stage(self, loader_state: dict[str, Any] | None = None, rng_state: dict[str, Any] | None = None,
               whole: tuple[dict[str, Any], dict[str, Any]] | None = None) -> StagedCheckpoint:
        model_state, optimizer_state = whole if whole is not None else self._whole_state()
        return stage_checkpoint(model_state=model_state, optimizer_state=optimizer_state,
                                **self._run_state(loader_state, rng_state))

    def _writes_a_file(self) -> bool:
        """Whether this rank writes a file of each checkpoint: rank 0 the whole state; with sharded
        checkpoints the ranks of the state-sharding mode's group whose index along every mesh dimension
        but its ``state_dims`` is 0 (the other ranks hold the same parts)."""
        if self.state_owner is None:
            return self.rank == 0
        dims = self.state_owner.state_dims
        return self.mesh is None or all(self.mesh.local_rank(d) == 0 for d in self.mesh.names if d not in dims)

    def _shard(self) -> tuple[Any, int, int]:
        """This rank's part of a sharded checkpoint, and its file's rank and number of files."""
        assert self.state_owner is not None
        group = self.state_owner.group
        return self.state_owner.state_shard(self.optimizer), group.rank, group.size

    def _write(self, path: Path, loader_state: dict[str, Any] | None = None,
               rng_state: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint now: every rank holding a part its shard (a mode that shards state), else rank 0 the whole
        state; returns once every rank's part is written."""
        if self.sharded:
            if self._writes_a_file():
                shard, rank, files = self._shard()
                save_sharded_checkpoint(path, shard, rank=rank, world_size=files,
                                        **self._run_state(loader_state, rng_state))
        else:
            whole = self._whole_state()
            if self.rank == 0:
                write_checkpoint(self._stage(loader_state, rng_state, whole), path)
        if self.group is not None:
            self.group.barrier()
        return path

    def save(self, path: Path) -> Path:
        """Write a checkpoint of the current state now (waiting for an asynchronous save in flight)."""
        if self.sharded and self.cfg.async_checkpoint:
            self._settle()
        elif self.writer is not None:
            self.writer.wait()
        return self._write(path)

    def _settle(self) -> None:
        """Complete the asynchronous sharded save in flight: each rank waits for its own file, then all
        meet, and only then, with every rank's file of the newest checkpoint durable, rank 0 deletes
        the old ones beyond ``--keep``. Every rank calls it."""
        if self.writer is not None:
            self.writer.wait()
        if self.group is not None:
            self.group.barrier()
        if self.rank == 0:
            self._rotate(self.out)

    def _save_step_checkpoint(self) -> Path:
        """The periodic checkpoint: staged now, written here or on the writer thread, then the old ones
        beyond ``--keep`` are deleted (only after the new one is durable)."""
        path = self.out / f"step_{self.step:06d}.safetensors"
        if self.cfg.async_checkpoint and self.sharded:
            # each rank stages its part and writes it on its thread; the previous save is settled first
            # (every rank's file written), one checkpoint interval after it started
            self._settle()
            if self.writer is not None:
                shard, rank, files = self._shard()
                staged, file = stage_sharded_checkpoint(path, shard, rank=rank, world_size=files,
                                                        **self._run_state())
                self.writer.submit(staged, file)
        elif self.cfg.async_checkpoint:
            # rank 0 alone stages and writes (replicas: its state is the run's); the other ranks go on
            # without a barrier, which rank 0 would not join
            if self.writer is not None:
                self.writer.check()
                staged = self._stage()  # the only part of an asynchronous save the loop waits for
                self.writer.submit(staged, path, then=self._rotate)
        else:
            self._write(path)
            if self.rank == 0:
                self._rotate(path)
        return path

    def _rotate(self, _: Path) -> None:
        rotate_checkpoints(self.out, self.cfg.keep)
        kept = step_checkpoints(self.out)
        if kept:  # the rank files of rotated checkpoints; not those of newer ones other ranks are writing
            remove_orphan_shards(self.out, below_step=kept[0][0])

    def _resume(self, path: str, state: dict[str, Any]) -> None:
        saved = state["config"].get("train", {}) if isinstance(state.get("config"), dict) else {}
        saved_optimizer = saved.get("optimizer")
        if isinstance(saved_optimizer, str) and saved_optimizer != self.cfg.optimizer:
            raise ConfigError(f"resume: {path} holds the state of optimizer {saved_optimizer!r}, but this run uses "
                              f"--optimizer {self.cfg.optimizer}; resume with --optimizer {saved_optimizer}, or start "
                              "a new run (another --out) to train with another optimizer")
        if self.state_owner is not None:  # each rank takes its parts of the whole state
            self.state_owner.load_full_state(state["model"], self.optimizer, state["optimizer"])
        else:
            self.net.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self._prefetched = None
        try:
            self.loader.load_state_dict(self._loader_state_for_this_layout(state["loader"]))
        except LoaderError as exc:
            batch, seq = saved.get("batch_size"), saved.get("seq_len")
            raise ConfigError(f"resume: {path} was trained with --batch-size {batch} --seq-len {seq} on other data or "
                              f"settings than this run (--batch-size {self.cfg.batch_size} --seq-len "
                              f"{self.cfg.seq_len}): {exc}. Resume with the run's own settings: blutrain train "
                              f"--config {Path(path).parent / 'config.toml'} --resume {path}") from None
        self.step = int(state["trainer"]["step"])
        self.val_history = [tuple(v) for v in state["trainer"].get("val_history", [])]
        self.skipped_steps = [int(s) for s in state["trainer"].get("skipped_steps", [])]
        self._set_rng_state(state["rng"])
        self._print(f"resumed from {path} at step {self.step}")

    def _loader_state_for_this_layout(self, state: dict[str, Any]) -> dict[str, Any]:
        """A loader state saved by another layout with the same global batch (4 ranks × 2 rows, or 1 × 8)
        reads the same tokens per step: the ranks of a step read adjacent slices. Restate it in this
        layout's terms; any other difference is left for the loader to report."""
        saved_b, saved_w = state.get("batch_size"), state.get("world_size")
        rows = self.cfg.batch_size * self.dp_size
        if isinstance(saved_b, int) and isinstance(saved_w, int) and saved_b * saved_w == rows:
            return {**state, "batch_size": self.cfg.batch_size, "world_size": self.dp_size}
        return state

    # -- micro-batch search --------------------------------------------------------------------
    def _choose_micro_batch(self, resume: dict[str, Any] | None) -> None:
        """``--auto-batch``: the largest micro-batch whose whole step (forward, backward, clip, optimizer)
        fits, trying the global batch first and halving on out-of-memory; gradient accumulation then
        keeps the global batch. A resumed run takes the micro-batch its checkpoint was trained with."""
        cfg = self.cfg
        global_batch = self.accum * cfg.batch_size
        if resume is not None:
            saved = resume["config"].get("train", {}) if isinstance(resume["config"], dict) else {}
            micro = saved.get("batch_size")
            if not isinstance(micro, int) or micro <= 0 or global_batch % micro:
                raise ConfigError(f"--auto-batch with --resume: the checkpoint's batch_size {micro!r} does not "
                                  f"divide the global batch of {global_batch} sequences")
            self._print(f"auto-batch: micro-batch {micro} from the checkpoint")
        else:
            micro = self._search_micro_batch(global_batch)
        if micro != cfg.batch_size:
            cfg.total_batch_tokens = global_batch * cfg.seq_len
            cfg.batch_size = micro
            self.accum = global_batch // micro
            self.loader = self._make_loader()
            self._prefetched = None

    def _search_micro_batch(self, global_batch: int) -> int:
        cfg = self.cfg
        saved_model = _host_tree(self.model.state_dict())
        saved_optimizer = _host_tree(self.optimizer.state_dict())
        saved_rng = self._rng_state()
        failed: list[str] = []
        micro = global_batch
        try:
            while True:
                try:
                    self._probe(micro)
                    break
                except MemoryError as exc:
                    failed.append(f"{micro}: {exc}")
                    smaller = smaller_micro_batch(global_batch, micro)
                    if smaller == 0:
                        raise TrainOutOfMemoryError(
                            f"--auto-batch: even a micro-batch of 1 × {cfg.seq_len} tokens runs out of memory on "
                            f"{self.device}: {exc}", step=self.step, micro_batch=1) from None
                    micro = smaller
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.load_state_dict(saved_model)
            self.optimizer.load_state_dict(saved_optimizer)
            self._set_rng_state(saved_rng)
        tried = "".join(f"\n  micro-batch {line}" for line in failed)
        self._print(f"auto-batch: micro-batch {micro} × {cfg.seq_len} tokens fits; {global_batch // micro} "
                    f"micro-batch(es) per step keep the global batch at {global_batch} sequences"
                    + (f"; out of memory at{tried}" if failed else ""))
        return micro

    def _probe(self, micro: int) -> None:
        """One whole training step at micro-batch ``micro`` on placeholder tokens; the caller restores
        the weights, optimizer state and RNG afterwards."""
        tokens = bt.zeros((micro, self.cfg.seq_len), dtype="int64", device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        losses = self._accumulate([(tokens, tokens)])
        self._grad_norm()
        self.optimizer.step()
        float(losses[0].item())  # waits for the device: a failure inside the step shows here

    # -- loop ----------------------------------------------------------------------------------
    def _batch(self, loader: TokenLoader) -> tuple[bt.Tensor, bt.Tensor]:
        x, y = loader.next_batch()
        return bt.from_numpy(x).to(self.device), bt.from_numpy(y).to(self.device)

    def loader_state(self) -> dict[str, Any]:
        """The training loader's position after the batches the steps so far consumed (what a checkpoint
        saves); ``self.loader`` itself may be a step ahead, having drawn the next step's batches early."""
        return self._prefetched[0] if self._prefetched is not None else self.loader.state_dict()

    def _step_batches(self) -> list[tuple[bt.Tensor, bt.Tensor]]:
        """This step's micro-batches on the device: those drawn early by the previous step, or drawn now."""
        if self._prefetched is not None:
            batches = self._prefetched[1]
            self._prefetched = None
            return batches
        return [self._batch(self.loader) for _ in range(self.accum)]

    def _prefetch(self) -> None:
        """Draw the next step's micro-batches and copy them to the device now, while this step's work runs
        there (called after it is launched, before its loss is read): the host work between two steps then
        overlaps the device's. Not past the run's last step."""
        if self.step + 1 < self.cfg.max_steps:
            state = self.loader.state_dict()
            self._prefetched = (state, [self._batch(self.loader) for _ in range(self.accum)])

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        return warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.lr * cfg.min_lr_ratio)

    def _accumulate(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> list[bt.Tensor]:
        """Forward and backward of every micro-batch, gradients summed into ``.grad``; the detached
        losses (the (B, T, vocab) logits are not kept alive through backward)."""
        losses = []
        for i, (x, y) in enumerate(batches):
            # every micro-batch but the last accumulates locally: the modes reduce once, in the last backward
            with contextlib.ExitStack() as local:
                if i < len(batches) - 1:
                    for mode in self.modes:
                        local.enter_context(mode.no_sync())
                with self.autocast:
                    loss = self.model(x, y, **self.loss_options)[1]
                (loss / len(batches)).backward()
            losses.append(loss.detach())
        return losses

    def _grad_norm(self) -> bt.Tensor:
        """The global gradient norm as a 0-d tensor on the device, clipping with it when ``clip`` > 0.
        This reduction is the whole non-finite check: a NaN or inf in any gradient element makes it
        non-finite, so no pass over the gradients is added."""
        if self.norm_source is not None:  # sharded gradients: the mode reduces the norm over its ranks
            total: bt.Tensor = (self.norm_source.clip_grad_norm_(self.cfg.clip) if self.cfg.clip > 0
                                else self.norm_source.grad_norm())
            return total
        params = self.net.parameters()
        if self.cfg.clip > 0:
            return clip_grad_norm_(params, self.cfg.clip)
        with no_grad():
            norms = [bt.norm(p.grad.detach()).to(dtype=bt.float32) for p in params if p.grad is not None]
            return bt.norm(bt.stack(norms)) if norms else bt.zeros((), device=self.device)

    def _read(self, losses: list[bt.Tensor], norm: bt.Tensor) -> tuple[float, float, bool]:
        """Mean loss (over micro-batches and ranks), gradient norm and whether both are finite, through
        one device-to-host copy: the step's one host sync. Every rank reads the same numbers, so every
        rank makes the same non-finite decision."""
        parts = [*(x.to(dtype=bt.float32) for x in losses), norm.to(dtype=bt.float32)]
        several = self.group is not None and self.world > 1
        if several:  # and whether any rank received a stop signal: all stop after this same step
            received = self._signals.received if self._signals is not None else None
            parts.append(bt.full((), float(received or 0), dtype=bt.float32, device=self.device))
        stacked = bt.stack(parts)
        if several:
            # in float64 the sum of the ranks' float32 values is exact in any order, so the mean loss does not
            # depend on the backend's order of additions: ranks that trained as one process report its losses
            stacked = stacked.to(dtype=bt.float64)
            self.group.all_reduce(stacked, op="avg")  # the norm is global already: an average of equal values
        values = stacked.tolist()
        if several:
            flag = values.pop()
            received = self._signals.received if self._signals is not None else None
            self._agreed_stop = (received or signal.SIGTERM) if flag > 0 else None
        loss = sum(values[:-1]) / len(losses)
        return loss, values[-1], all(math.isfinite(v) for v in values)

    def _step_body(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> tuple[list[bt.Tensor], bt.Tensor]:
        """One optimizer step on ``batches`` (the micro-batches): what ``--compile`` traces and replays.
        It ends with ``zero_grad`` so that no gradient outlives the compiled graph."""
        losses = self._accumulate(batches)
        norm = self._grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses, norm

    def train_step(self) -> dict[str, Any]:
        """One optimizer step. A NaN or infinite loss or gradient norm is handled by ``on_nonfinite``;
        running out of device memory raises :class:`TrainOutOfMemoryError` with the allocator's summary.

        Its ``step_ms`` (and ``tok_per_s``, MFU) is the host's time from this call to the step's loss read back
        and checked: everything launched for this step, the host work done while it runs on the device (the
        next step's batches, the previous step's deferred bookkeeping) and the wait for the device. What the loop
        does between two steps besides (evaluation, checkpoints) is not in it."""
        cfg = self.cfg
        if self.writer is not None:
            self.writer.check()  # a failed asynchronous save surfaces here, one step after it was started
        t0 = time.perf_counter()
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # the eager step's last good state, kept when it stops; the compiled step keeps none (see _nonfinite)
        keep_state = cfg.on_nonfinite == "stop" and self.compiled_step is None
        before = (self.loader_state(), self._rng_state()) if keep_state else None
        try:
            if not self.model.training:  # a walk over every module (~0.1 ms for GPT-2 124M): only when needed
                self.model.train()
            batches = self._step_batches()
            if self.compiled_step is not None:
                losses, grad_norm = self.compiled_step(batches)
            else:
                self.optimizer.zero_grad(set_to_none=True)
                losses, grad_norm = self._accumulate(batches), self._grad_norm()
            # host work while the launched step runs on the device
            self._prefetch()
            self._run_deferred()
            loss, norm, finite = self._read(losses, grad_norm)
            if finite and self.compiled_step is None:
                self.optimizer.step()
        except MemoryError as exc:
            raise step_out_of_memory(exc, step=self.step + 1, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                     device=self.device) from exc
        m: dict[str, Any] = {"step": self.step + 1, "loss": loss, "lr": lr, "grad_norm": norm}
        if not finite:
            self._nonfinite(m, before)
            m["skipped"] = True
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = self.accum * cfg.batch_size * cfg.seq_len * self.dp_size
        return m | {"tok_per_s": tokens / dt, "step_ms": dt * 1e3} | self.throughput.metrics(tokens / dt)

    def _run_deferred(self) -> None:
        """Do the bookkeeping run() deferred from the step before, if any (once: it is taken before it runs)."""
        work, self._deferred = self._deferred, None
        if work is not None:
            work()

    def _nonfinite(self, m: dict[str, Any], before: tuple[dict[str, Any], dict[str, Any]] | None) -> None:
        step, what = m["step"], f"loss {m['loss']}, gradient norm {m['grad_norm']}"
        self._emit("nonfinite", {"step": step, "loss": m["loss"], "grad_norm": m["grad_norm"],
                            "policy": self.cfg.on_nonfinite})
        if self.cfg.on_nonfinite == "skip":
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps.append(step)
            self._print(f"step {step}: non-finite {what}; the update is skipped (--on-nonfinite skip)")
            return
        if self.writer is not None:
            self.writer.wait()
        if self.compiled_step is not None:
            found = step_checkpoints(self.out)
            kept = found[-1][1] if found else None
            where = (f"the newest checkpoint before it is {kept} (step {found[-1][0]})" if kept else
                     "no checkpoint was written before it (--checkpoint-every)")
            raise NonFiniteError(
                f"step {step}: non-finite {what}; stopping (--on-nonfinite stop). The compiled step applies the "
                f"optimizer inside its graph, so the weights in memory already hold this update and are not "
                f"saved; {where}", step=step, loss=m["loss"], grad_norm=m["grad_norm"], checkpoint=kept)
        assert before is not None
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"step_{self.step:06d}.safetensors"  # the optimizer has not run: the state is good
        self._write(path, *before)
        raise NonFiniteError(
            f"step {step}: non-finite {what}; stopping (--on-nonfinite stop). The last good state (after step "
            f"{self.step}) is in {path}", step=step, loss=m["loss"], grad_norm=m["grad_norm"], checkpoint=path)

    def evaluate(self) -> float | None:
        if self.data.val_pattern is None:
            return None
        val = TokenLoader(self.data.val_pattern, self.cfg.batch_size, self.cfg.seq_len, seed=self.cfg.seed)
        self.model.eval()
        losses = []
        with no_grad():
            for _ in range(self.cfg.eval_batches):
                x, y = self._batch(val)
                with self.autocast:
                    _, loss = self.model(x, y, **self.loss_options)
                losses.append(loss.detach())
        self.model.train()
        # one device-to-host read for every batch, not one each; summed on the host in batch order
        values: list[float] = bt.stack(losses).to(dtype=bt.float32).tolist()
        return sum(values) / self.cfg.eval_batches

    def release_compiled(self) -> None:
        """Give back the compiled step's graphs and memory. A trainer in a process group registers it with
        ``blutrain.dist.before_destroy``: NCCL waits, in destroying a communicator, for every CUDA graph that
        captured one of its collectives (a compiled parallel step's), so a graph still held then would hang
        ``destroy_process_group``."""
        if self.compiled_step is not None:
            self.compiled_step.reset()

    def sample(self, prompt: str, tokens: int) -> str:
        """``tokens`` tokens sampled after ``prompt``, decoded (raises TokenizerUnavailableError when the
        data's tokenizer could not be loaded: ``tokenizer_problem`` says why)."""
        if self.tokenizer is None:
            raise TokenizerUnavailableError(self.tokenizer_problem or f"no {self.data.tokenizer} tokenizer")
        tok = self.tokenizer
        ids = tok.encode(prompt) or [tok.eot_token]
        idx = bt.tensor([ids], dtype="int64", device=self.device)
        net = self.net
        if any(mode.rewrites_layers for mode in self.modes):
            # the model's layers take sharded inputs now: sample with a whole copy
            net = self.model_spec.build(self.model_config).to(self.device)
            net.load_state_dict(self.state_owner.full_state_dict() if self.state_owner is not None
                                else self.net.state_dict())
        with contextlib.ExitStack() as whole:  # every parameter whole on every rank while sampling
            for mode in self.modes:
                whole.enter_context(mode.gathered())
            out = net.generate(idx, tokens, temperature=0.8, top_k=40, seed=self.cfg.seed)
        return tok.decode(out[0].tolist())

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        # rank 0 checks again, creates and empties; every rank checked when it was built, before any wrote
        # (a rank that checked now could see rank 0's new config.toml as an old run)
        removed = []
        if self.rank == 0:
            removed = prepare_run_directory(self.out, resuming=bool(cfg.resume), overwrite=cfg.overwrite)
        else:
            self.out.mkdir(parents=True, exist_ok=True)
        if removed:
            self._print(f"--overwrite: removed the previous run's {len(removed)} file(s) from {self.out}")
        if self.rank == 0:
            (self.out / "config.toml").write_text(cfg.to_toml())
            if self.default_out and not cfg.resume:
                point_latest(self.out)
        ranks = f" × {self.world} ranks ({cfg.parallel})" if self.group is not None else ""
        model = cfg.preset or cfg.init_from
        self._print(f"BluTrain: {cfg.model} '{model}' ({self.n_params / 1e6:.2f} M parameters) on {self.device}, "
                    f"{cfg.optimizer}, {cfg.batch_size}×{cfg.seq_len} tokens × {self.accum} per step{ranks}, "
                    f"{cfg.max_steps} steps; writing to {self.out}")
        if self.data.baseline_nats is not None:
            self._print(f"data: {self.data.train_pattern} (byte-unigram entropy of val: "
                        f"{self.data.baseline_nats:.3f} nats/token — the loss to beat)")
        if cfg.data is not None and self.data.val_pattern is None:
            self._print(f"data: {cfg.data} has no validation split; training without validation")
        if cfg.init_from is not None:
            self._print(f"initialised from {cfg.init_from}")
        if self.tokenizer_problem is not None:
            self._print(f"note: no sample at the end: {self.tokenizer_problem}")
        stale = remove_stale_temporaries(self.out) if self.rank == 0 else []
        if stale:
            self._print(f"removed {len(stale)} temporary file(s) of interrupted checkpoint saves in {self.out}")
        metrics_path = self.out / "metrics.jsonl" if self.rank == 0 else Path(os.devnull)
        resumed_step = self.step if cfg.resume else None
        self._emit("train_start", {"step": self.step, "config": cfg.to_dict()})
        start = time.perf_counter()
        first_step = self.step
        final_val: float | None = None
        evaluated = False
        # SIGINT/SIGTERM are held from the first step until the final checkpoint is written: before the last
        # step they stop the run at the next step boundary, after it the run finishes writing first
        with StopSignals() as signals:
            self._signals = signals
            try:
                with MetricsLog(metrics_path, resumed_step) as metrics:
                    try:
                        while self.step < cfg.max_steps:
                            m = self.train_step()
                            ended = time.perf_counter()
                            last = self.step == cfg.max_steps
                            stop = None if last else self._stop_requested()
                            evaluate = stop is None and bool(last or (cfg.eval_every
                                                                      and self.step % cfg.eval_every == 0))
                            checkpoint = bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                                              and not last)
                            if not (last or evaluate or checkpoint or stop is not None):
                                # the next step does this step's bookkeeping once it is launched (train_step)
                                self._deferred = partial(self._record, metrics, m, start, first_step, ended)
                                continue
                            if evaluate:
                                val = self.evaluate()
                                evaluated = last
                                if val is not None:
                                    m["val_loss"] = final_val = val
                                    self.val_history.append((self.step, val))
                                    self._emit("eval_end", {"step": self.step, "val_loss": val})
                            self._record(metrics, m, start, first_step, ended)
                            saved = None
                            if checkpoint:
                                saved = self._save_step_checkpoint()
                                self._emit("checkpoint_saved", {"step": self.step, "path": str(saved)})
                            if stop is not None:
                                self._stop(stop, saved)
                    finally:  # a step that failed or was interrupted before it did its predecessor's bookkeeping
                        self._run_deferred()
                if self.writer is not None:
                    self.writer.wait()
            except BaseException:
                if self.writer is not None:  # let a save in flight finish: it holds good state
                    with contextlib.suppress(CheckpointError):
                        self.writer.wait()
                raise
            finally:
                self._signals = None
            if self.stream.isatty():
                self.stream.write("\n")
            if not evaluated:  # the loop did not reach the last step here (a run resumed at its end)
                final_val = self.evaluate()
                if final_val is not None:
                    self.val_history.append((self.step, final_val))
                    self._print(f"validation loss at step {self.step}: {final_val:.4f}")
            ckpt = self.save(self.out / "final.safetensors")
            plot = self._plot() if self.rank == 0 else None
        received = signals.received
        result = {"step": self.step, "val_loss": final_val, "checkpoint": str(ckpt),
                  "train_loss": self.history[-1]["loss"] if self.history else None}
        if received is not None and self.world == 1:  # came after the last step: the run is whole, then stop
            name = signal_name(received)
            self._emit("train_end", result | {"interrupted": name})
            raise TrainInterruptedError(f"{name} received: the run had finished its {self.step} steps; wrote {ckpt}",
                                        signal_number=received, step=self.step, checkpoint=ckpt)
        self._emit("train_end", result)
        return result | {"plot": str(plot) if plot else None}

    # -- stopping on a signal --------------------------------------------------------------------
    def _stop_requested(self) -> int | None:
        """The stop signal this step ended with, or None. One process: the signal it received. Several
        ranks: the decision every rank read in the step's one reduction (``_read``), so that all stop after
        the same step even when the launcher's forwarded signal reached them at different moments."""
        if self.world > 1:
            return self._agreed_stop
        return self._signals.received if self._signals is not None else None

    def _stop(self, signum: int, saved: Path | None) -> None:
        """At a step boundary after SIGINT/SIGTERM: a checkpoint of this step (unless the periodic one was just
        written), the plot, then :class:`TrainInterruptedError` saying how to resume."""
        path = saved if saved is not None else self.out / f"step_{self.step:06d}.safetensors"
        if saved is None:
            self.save(path)
            if self.rank == 0:
                self._rotate(path)
        elif self.writer is not None:
            self._settle() if self.sharded else self.writer.wait()
        plot = self._plot() if self.rank == 0 else None
        if self.stream.isatty():
            self.stream.write("\n")
        name = signal_name(signum)
        self._emit("train_end", {"step": self.step, "val_loss": None, "checkpoint": str(path), "train_loss":
                                 self.history[-1]["loss"] if self.history else None, "interrupted": name})
        wrote = f"{path}" + (f" and {plot}" if plot else "")
        # a run started with init_from resumes from its checkpoint alone (init_from and resume both set weights)
        note = f" (with the line init_from = ... taken out of {self.out / 'config.toml'})" if self.cfg.init_from else ""
        raise TrainInterruptedError(
            f"{name} received: stopped after step {self.step} of {self.cfg.max_steps} and wrote {wrote}; resume "
            f"with: blutrain train --config {self.out / 'config.toml'} --resume {path}{note}", signal_number=signum,
            step=self.step, checkpoint=path)

    # -- output --------------------------------------------------------------------------------
    def _emit(self, event: str, state: dict[str, Any]) -> None:
        if self.rank == 0:  # loggers and the like see one run, not one per rank
            _emit(event, state)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _record(self, metrics: MetricsLog, m: dict[str, Any], start: float, first_step: int, ended: float) -> None:
        """A step's bookkeeping: its metrics.jsonl row, history, ``step_end`` event and progress line. ``ended``:
        when the step's loss was read back (the progress line's ETA counts up to then, also when deferred)."""
        dropped = metrics.write(m)
        if dropped:
            self._print(f"dropped {dropped} row(s) after step {metrics.resumed_step} from {metrics.path}: "
                        "those steps were trained again")
        self.history.append(m)
        self._emit("step_end", dict(m))
        self._progress(m, start, first_step, ended)

    def _progress(self, m: dict[str, Any], start: float, first_step: int, ended: float) -> None:
        step = m["step"]  # this step's, not self.step: the line may be written while the next step runs
        done = step - first_step
        total = self.cfg.max_steps - first_step
        elapsed = ended - start
        eta = elapsed / max(done, 1) * (total - done)
        width = 24
        filled = int(width * step / self.cfg.max_steps)
        bar = "█" * filled + "·" * (width - filled)
        line = (f"[{bar}] step {step}/{self.cfg.max_steps}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  "
                f"{m['tok_per_s']:,.0f} tok/s")
        if "mfu" in m:
            line += f"  MFU {m['mfu']:.1%}"
        if "mem_peak_bytes" in m:
            line += f"  mem {m['mem_peak_bytes'] / 2**30:.2f} GiB"
        line += f"  ETA {eta:4.0f}s"
        if self.stream.isatty():
            self.stream.write("\r" + line + "\x1b[K")  # erase what a longer previous line left
            self.stream.flush()
        elif step % max(self.cfg.max_steps // 20, 1) == 0 or step == 1:
            self._print(line)
        if "val_loss" in m:  # its own line: the next step's progress line overwrites this one on a terminal
            if self.stream.isatty():
                self.stream.write("\n")
            self._print(f"step {step}: validation loss {m['val_loss']:.4f}")

    def _plot(self) -> Path | None:
        from blutrain.train.plot import plot_losses

        return plot_losses(self.out / "metrics.jsonl", self.out / "loss.png", self.val_history)
