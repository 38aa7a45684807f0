"""One rank of a tools/bench/dist.py launch: runs the launch's configurations one after another and reports
each to ``rank<R>.json`` beside the job file (rewritten after every step, so a rank that is stopped still
says where it was).

- BluTrain: each configuration is a :class:`blutrain.train.Trainer` built as ``blutrain train`` builds it
  (``--parallel`` mode, ``--compile``, ``--dtype``, gradient accumulation through ``total_batch_tokens``),
  stepped with ``train_step``, which ends with the step's one host read of the loss: its wall time is the
  step a user trains at.
- PyTorch: tools/bench/gpt2.py's implementation of the job's model family (``TORCH_MODELS``; nanoGPT style for
  GPT-2), ``torch.optim.AdamW(fused=True)``, clip 1.0, autocast, wrapped in ``DistributedDataParallel``
  (``ddp``), DDP with ``ZeroRedundancyOptimizer`` (``zero1``), FSDP by block (``zero2``: SHARD_GRAD_OP,
  ``zero3``: FULL_SHARD), or FSDP2 (``fsdp2``: ``fully_shard`` of every transformer block, then of the root;
  under bf16 its ``MixedPrecisionPolicy`` gathers bf16 parameters and reduces gradients in float32);
  ``torch.compile`` of the wrapped model for ``compiled``, except under fsdp2, where each block is compiled
  before it is sharded (torchtitan's order: FSDP2's hooks stay outside the compiled code). ``tp`` and
  ``tp-async``: DTensor's ``parallelize_module`` over every rank (tools/bench/dist_torch_tp.py), each rank on
  the one-GPU run's rows; a mode this PyTorch or device cannot run is skipped, saying why. The step reads its
  loss (averaged over the data-parallel ranks) on the host, as BluTrain's does. PyTorch is imported here only,
  inside the rank that runs it.

A configuration that raises is written with its error, and the rank exits at once (the launcher then stops
its peers, which may be blocked in a collective); tools/bench/dist.py relaunches the configurations left.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import dist_torch_tp
from bench.dist_profile import PROFILE_RANGE_PREFIX, TORCH_TRACE_SUFFIX, UNDER_NSYS_ENV
from bench.dist_report import SAME_BATCH_MODES, Config
from bench.dist_torch_tp import TensorParallelUnavailableError, TorchTensorParallel

WORKER_FAILED = 3  # a rank's exit code after it wrote its error to its JSON
TEARDOWN_S = 30.0  # seconds a rank waits for its process group to come apart after writing its results
TRAINER_MODES = {"single": "", "ddp": "ddp", "zero1": "zero=1", "zero2": "zero=2", "zero3": "zero=3",
                 "ddp-bf16": "ddp,grad_dtype=bf16", "tp": "tp={gpus}", "tp-async": "tp={gpus},async=4",
                 "ddp-ordered": "ddp,reduce=ordered"}
HYPER = {"lr": 6e-4, "weight_decay": 0.1, "clip": 1.0}  # tools/bench/gpt2.py's recipe, constant learning rate


@dataclass
class Job:
    """What a launch runs: ``configs`` in order on every rank. ``data``: the trainer's ``--data`` (None: the
    stdlib corpus); ``train_pattern``/``vocab_size``: the same shards for PyTorch's loader. ``deadline``:
    epoch seconds after which configurations are skipped (rank 0 decides, every rank follows).
    ``profile``: rank 0 profiles each configuration's ``profile_steps`` last steps, under ``torch.profiler`` into
    ``trace_dir/<name>.trace.json`` (``trace_dir`` set by the driver), or under nsys (``nsys_prefix``)."""

    framework: str
    gpus: int
    device: str
    model: str
    preset: str
    data: str | None
    train_pattern: str
    vocab_size: int
    seed: int
    configs: list[Config]
    overrides: dict[str, Any]
    deadline: float | None = None
    nsys_prefix: list[str] | None = None
    trace_dir: str | None = None

    @staticmethod
    def from_json(text: str) -> Job:
        raw = json.loads(text)
        raw["configs"] = [Config(**c) for c in raw["configs"]]
        return Job(**raw)


def gpt2_bench() -> Any:
    """tools/bench/gpt2.py (its reference model, clocks and memory meters), imported as this file's sibling."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("gpt2")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def is_out_of_memory(exc: BaseException) -> bool:
    """BluTrain's allocators raise MemoryError subclasses; PyTorch's OutOfMemoryError is a RuntimeError."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc)


class RankReport:
    """This rank's ``rank<R>.json``: one entry per configuration reached, rewritten atomically."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.data: dict[str, Any] = {"rank": rank, "current": None, "configs": {}}
        self.write()

    def start(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"rank": self.data["rank"], "status": "running", "phase": "start", "losses": [],
                                 "step_ms": []}
        self.data["configs"][name] = entry
        self.data["current"] = name
        self.write()
        return entry

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


class Steps:
    """A configuration's steps on this rank: warm-up under the memory meter, timed steps, then the profiled
    ones (rank 0 inside an NVTX range and the CUDA profiler's capture range when it runs under nsys)."""

    def __init__(self, report: RankReport, entry: dict[str, Any], meter: Any, profiler: Any) -> None:
        self.report, self.entry, self.meter, self.profiler = report, entry, meter, profiler

    def phase(self, name: str) -> None:
        self.entry["phase"] = name
        self.report.write()

    def run(self, c: Config, step: Callable[[], float]) -> None:
        e = self.entry
        self.phase("warm-up")
        for i in range(c.warmup):
            e["losses"].append(_finite(step(), i))
            self.report.write()
        e["peak_allocated"] = self.meter.end()[0]
        self.phase("timed")
        for i in range(c.warmup, c.warmup + c.steps):
            t0 = time.perf_counter()
            loss = step()  # returns after the step's host read of its loss: the device is done
            e["step_ms"].append((time.perf_counter() - t0) * 1e3)
            e["losses"].append(_finite(loss, i))
            self.report.write()  # after the step's clock: not timed
        if c.profile_steps:
            self.phase("profiled")
            with self.profiler(PROFILE_RANGE_PREFIX + c.name, e):
                for _ in range(c.profile_steps):
                    step()


def _finite(value: float, step: int) -> float:
    if not math.isfinite(value):
        raise FloatingPointError(f"non-finite loss {value} at step {step}")
    return value


# -- BluTrain ----------------------------------------------------------------------------------------------
class BluTrainRank:
    def __init__(self, job: Job) -> None:
        import blutrain.dist as dist

        self.job = job
        self.cuda = job.device == "cuda"
        env = dist.detect()
        self.rank, self.world, self.local = env.rank, env.world_size, env.local_rank
        self.device = f"cuda:{self.local}" if self.cuda else "cpu"
        if self.cuda:
            import cupy

            cupy.cuda.Device(self.local).use()
        self.group: Any = None
        if self.world > 1:  # one group for every configuration; each Trainer finds it initialized
            self.group = dist.init_process_group("nccl" if self.cuda else "mpi")
        self.g2 = gpt2_bench()
        self.tmp = Path(tempfile.mkdtemp(prefix="bench_dist_"))

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank."""
        if self.group is None:
            return flag
        import numpy as np

        import blutrain.tensor as bt

        t = bt.from_numpy(np.array([1.0 if flag else 0.0], dtype=np.float32)).to(self.device)
        self.group.broadcast(t, src=0)
        return float(t.item()) > 0.5

    def profiler(self, name: str, entry: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        if not self.cuda:
            return contextlib.nullcontext()
        import cupy

        return step_profiler(self.job, self.rank, name, entry, cupy.cuda.runtime.deviceSynchronize, "cupy.cuda")

    def run(self, c: Config, report: RankReport, entry: dict[str, Any]) -> None:
        try:
            self.train(c, report, entry)
        finally:
            self.free()  # the trainer is gone with train()'s frame

    def train(self, c: Config, report: RankReport, entry: dict[str, Any]) -> None:
        from blutrain.train import TrainConfig, Trainer

        job = self.job
        tc = TrainConfig(model=job.model, preset=job.preset, data=job.data, device=self.device, dtype=c.precision,
                         batch_size=c.batch_size, seq_len=c.seq_len,
                         total_batch_tokens=c.tokens_per_step if c.accum > 1 else 0,
                         max_steps=c.warmup + c.steps + c.profile_steps, lr=HYPER["lr"], min_lr_ratio=1.0,
                         warmup_steps=c.lr_warmup, weight_decay=HYPER["weight_decay"], clip=HYPER["clip"], eval_every=0,
                         out=str(self.tmp / c.name), seed=job.seed, compile=c.impl == "compiled",
                         parallel=TRAINER_MODES[c.mode].format(gpus=c.gpus), model_overrides=dict(job.overrides))
        meter = self.g2.blutrain_meter() if self.cuda else self.g2.Meter()
        entry["memory_source"] = meter.source
        meter.baseline()
        meter.begin()
        entry["phase"] = "build"
        report.write()
        trainer = Trainer(tc, stream=io.StringIO())
        entry["params"] = trainer.n_params
        entry["accum"] = trainer.accum
        try:
            Steps(report, entry, meter, self.profiler).run(c, lambda: float(trainer.train_step()["loss"]))
        finally:
            trainer.release_compiled()  # its graphs and their memory, before the next configuration

    def free(self) -> None:
        gc.collect()
        if not self.cuda:
            return
        import cupy

        from blutrain_backend_cupy import cuda

        cuda.synchronize()
        cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()

    def teardown(self) -> None:
        if self.group is not None:
            import blutrain.dist as dist

            dist.destroy_process_group()


def step_profiler(job: Job, rank: int, name: str, entry: dict[str, Any], synchronize: Callable[[], Any],
                  cuda_module: str) -> contextlib.AbstractContextManager[None]:
    """What a cuda rank's profiled steps run under: rank 0 under ``torch.profiler`` where the driver asked for
    traces (``job.trace_dir``), a rank under nsys in the CUDA profiler's capture range and an NVTX range (from
    ``cuda_module``'s ``profiler`` and ``nvtx``: "cupy.cuda" or "torch.cuda"), else nothing."""
    if rank == 0 and job.trace_dir:
        return _kineto_traced(Path(job.trace_dir), name, entry, synchronize)
    if os.environ.get(UNDER_NSYS_ENV):
        return _profiled(name, entry, synchronize, f"{cuda_module}.profiler", f"{cuda_module}.nvtx")
    return contextlib.nullcontext()


@contextlib.contextmanager
def _profiled(name: str, entry: dict[str, Any], synchronize: Callable[[], Any], profiler_module: str,
              nvtx_module: str) -> Any:
    """The CUDA profiler's capture range and an NVTX range named ``name`` around the block, the device idle at
    both ends. A profiler or NVTX that fails is noted in ``entry`` and the block runs anyway: the other ranks
    take the same steps, and this rank must not leave them waiting in a collective."""
    synchronize()
    stop: list[Callable[[], Any]] = []
    try:
        profiler: Any = importlib.import_module(profiler_module)
        profiler.start()
        stop.append(profiler.stop)
        nvtx: Any = importlib.import_module(nvtx_module)
        push, pop = (nvtx.RangePush, nvtx.RangePop) if hasattr(nvtx, "RangePush") else (nvtx.range_push, nvtx.range_pop)
        push(name)
        stop.insert(0, pop)
    except Exception as exc:
        entry["profile_note"] = f"profiler not started: {first_line(exc)}"
    try:
        yield
    finally:
        synchronize()
        for fn in stop:
            with contextlib.suppress(Exception):
                fn()


# -- PyTorch -----------------------------------------------------------------------------------------------
class TorchRank:
    def __init__(self, job: Job) -> None:
        import datetime

        self.torch: Any = importlib.import_module("torch")
        torch = self.torch
        self.job = job
        self.cuda = job.device == "cuda"
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = f"cuda:{self.local}" if self.cuda else "cpu"
        if self.cuda:
            torch.cuda.set_device(self.local)
        if self.world > 1:
            options: dict[str, Any] = {"device_id": torch.device("cuda", self.local)} if self.cuda else {}
            # a collective that hangs is stopped by the bench's --config-timeout, which also covers torch.compile
            # keeping one rank away from the first collective for a while
            torch.distributed.init_process_group("nccl" if self.cuda else "gloo",
                                                 timeout=datetime.timedelta(seconds=600), **options)
        self.g2 = gpt2_bench()

    def agree(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = self.torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.torch.distributed.broadcast(t, src=0)
        return float(t.item()) > 0.5

    def profiler(self, name: str, entry: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        if not self.cuda:
            return contextlib.nullcontext()
        return step_profiler(self.job, self.rank, name, entry, self.torch.cuda.synchronize, "torch.cuda")

    def run(self, c: Config, report: RankReport, entry: dict[str, Any]) -> None:
        try:
            self.train(c, report, entry)
        finally:
            # the model and optimizer are gone with train()'s frame
            self.free(compiled=c.impl == "compiled", async_tp=c.mode == "tp-async")

    def train(self, c: Config, report: RankReport, entry: dict[str, Any]) -> None:
        torch, job = self.torch, self.job
        from blutrain.data import TokenLoader
        from blutrain.models import model_spec

        torch.set_float32_matmul_precision("high" if c.precision == "tf32" else "highest")
        compiled = c.impl == "compiled"
        if c.mode == "tp-async":  # before the build: a mode that cannot run costs nothing
            dist_torch_tp.check_async_tp(torch, compiled, self.cuda)
        meter = self.g2.torch_meter() if self.cuda else self.g2.Meter()
        entry["memory_source"] = meter.source
        meter.baseline()
        meter.begin()
        entry["phase"] = "build"
        report.write()
        model_cfg = model_spec(job.model).config(job.preset, **job.overrides)
        torch.manual_seed(job.seed)
        with torch.device(self.device):
            model = self.g2.TORCH_MODELS[job.model](model_cfg)
        entry["params"] = sum(p.numel() for p in model.parameters())
        tp = self.tensor_parallel(model, model_cfg, c) if c.mode in SAME_BATCH_MODES else None
        wrapped, clip = (model, tp.clip) if tp is not None else self.wrap(model, c.mode, c.precision, compiled)
        params = list(model.parameters())  # after wrapping: fully_shard and parallelize_module replace them
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": HYPER["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt, entry["optimizer"] = self.optimizer(groups, c.mode)
        forward = torch.compile(wrapped) if compiled and c.mode != "fsdp2" else wrapped  # fsdp2: compiled by block
        # tensor parallelism: every rank on the rows of the one-GPU run, whose loss it computes whole
        data_rank, data_ranks = (0, 1) if tp is not None else (self.rank, self.world)
        loader = TokenLoader(job.train_pattern, c.batch_size, c.seq_len, rank=data_rank, world_size=data_ranks,
                             seed=job.seed, vocab_size=job.vocab_size)
        no_sync = getattr(wrapped, "no_sync", None)
        loss_context = tp.loss_context if tp is not None else contextlib.nullcontext
        local_loss = tp.local_loss if tp is not None else (lambda loss: loss)

        done = [0]  # optimizer steps taken: the warm-up's position

        def step() -> float:
            # BluTrain's schedule (warmup_cosine with min_lr = lr): linear warm-up, then constant
            lr = HYPER["lr"] * min(1.0, (done[0] + 1) / c.lr_warmup) if c.lr_warmup else HYPER["lr"]
            for group in opt.param_groups:
                group["lr"] = lr
            done[0] += 1
            opt.zero_grad(set_to_none=True)
            total = torch.zeros((), device=self.device)
            for k in range(c.accum):
                x, y = (torch.from_numpy(a).to(self.device, non_blocking=True) for a in loader.next_batch())
                local = no_sync() if no_sync is not None and k < c.accum - 1 else contextlib.nullcontext()
                with local, loss_context():
                    with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16,
                                        enabled=c.precision == "bf16"):
                        loss = forward(x, y)
                    (loss / c.accum).backward()
                total += local_loss(loss).detach().float()
            clip(HYPER["clip"])
            opt.step()
            if data_ranks > 1:
                torch.distributed.all_reduce(total)
            return float(total.item()) / (c.accum * data_ranks)

        Steps(report, entry, meter, self.profiler).run(c, step)

    def tensor_parallel(self, model: Any, model_cfg: Any, c: Config) -> TorchTensorParallel:
        """``model`` parallelized in place over every rank (tp-async: sequence parallel, and inductor's
        micro-pipeline TP pass on until :meth:`free`)."""
        asynchronous = c.mode == "tp-async"
        tp = dist_torch_tp.tensor_parallel(self.torch, model, model_cfg, self.job.model, self.world,
                                           "cuda" if self.cuda else "cpu", c.seq_len, sequence_parallel=asynchronous)
        if asynchronous:
            dist_torch_tp.enable_async_tp(self.torch, tp.mesh)
        return tp

    def wrap(self, model: Any, mode: str, precision: str, compiled: bool) -> tuple[Any, Callable[[float], Any]]:
        """The model as ``mode`` trains it, and what clips its gradients' global norm."""
        torch = self.torch
        if mode == "fsdp2":
            self.fully_shard(model, precision, compiled)
            sharded = list(model.parameters())
            return model, lambda v: torch.nn.utils.clip_grad_norm_(sharded, v)  # DTensors: a global norm
        params = list(model.parameters())
        if mode == "single":
            return model, lambda v: torch.nn.utils.clip_grad_norm_(params, v)
        if mode in ("ddp", "zero1", "ddp-bf16"):
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[self.local] if self.cuda else None)
            if mode == "ddp-bf16":  # gradients cast to bf16 for the all-reduce, the average back in float32
                hooks: Any = importlib.import_module("torch.distributed.algorithms.ddp_comm_hooks.default_hooks")
                ddp.register_comm_hook(None, hooks.bf16_compress_hook)
            return ddp, lambda v: torch.nn.utils.clip_grad_norm_(params, v)
        fsdp_api: Any = importlib.import_module("torch.distributed.fsdp")
        wrap_api: Any = importlib.import_module("torch.distributed.fsdp.wrap")
        strategy = fsdp_api.ShardingStrategy.SHARD_GRAD_OP if mode == "zero2" else fsdp_api.ShardingStrategy.FULL_SHARD
        fsdp = fsdp_api.FullyShardedDataParallel(
            model, sharding_strategy=strategy, use_orig_params=True, device_id=self.local if self.cuda else None,
            auto_wrap_policy=wrap_api.ModuleWrapPolicy({type(transformer_blocks(torch, model)[0])}))
        return fsdp, lambda v: fsdp.clip_grad_norm_(v)

    def fully_shard(self, model: Any, precision: str, compiled: bool) -> None:
        """FSDP2 in place: ``fully_shard`` of each transformer block (compiled first when ``compiled``), then of
        the root (embedding, final norm, head). bf16: parameters gathered in bf16, gradients reduced in float32
        (autocast still runs the loss in float32, as in the other modes)."""
        torch = self.torch
        fsdp: Any = importlib.import_module("torch.distributed.fsdp")
        if not hasattr(fsdp, "fully_shard"):
            raise RuntimeError(f"--torch-modes fsdp2 needs torch.distributed.fsdp.fully_shard (torch >= 2.6); this "
                               f"is torch {torch.__version__}")
        policy = (fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if precision == "bf16" else fsdp.MixedPrecisionPolicy())
        blocks = transformer_blocks(torch, model)
        for i, block in enumerate(list(blocks)):
            if compiled:
                block = torch.compile(block)
                blocks.register_module(str(i), block)
            fsdp.fully_shard(block, mp_policy=policy)
        fsdp.fully_shard(model, mp_policy=policy)

    def optimizer(self, groups: list[dict[str, Any]], mode: str) -> tuple[Any, str]:
        torch = self.torch
        kw: dict[str, Any] = {"lr": HYPER["lr"], "betas": (0.9, 0.95), "eps": 1e-8}
        fused = {"fused": True} if self.cuda else {"foreach": True}
        name = f"torch.optim.AdamW({next(iter(fused))}=True)"
        if mode == "zero1":
            zero_api: Any = importlib.import_module("torch.distributed.optim")
            opt = zero_api.ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                          weight_decay=groups[0]["weight_decay"], **kw, **fused)
            opt.add_param_group(groups[1])
            return opt, f"ZeroRedundancyOptimizer over {name}"
        return torch.optim.AdamW(groups, **kw, **fused), name

    def free(self, compiled: bool, async_tp: bool) -> None:
        if async_tp:
            dist_torch_tp.disable_async_tp()
        gc.collect()
        if compiled:
            self.torch._dynamo.reset()
            gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def teardown(self) -> None:
        if self.world > 1:
            self.torch.distributed.destroy_process_group()


def transformer_blocks(torch: Any, model: Any) -> Any:
    """The model's ``nn.ModuleList`` of transformer blocks, what FSDP shards one by one: tools/bench/gpt2.py's
    implementations hold exactly one (``transformer.h``, ``model.layers``), whichever the family."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1 or not len(lists[0]):
        raise ValueError(f"{type(model).__name__}: FSDP shards the blocks of the model's one nn.ModuleList; found "
                         f"{len(lists)} ModuleList(s)")
    return lists[0]


@contextlib.contextmanager
def _kineto_traced(folder: Path, name: str, entry: dict[str, Any], synchronize: Callable[[], Any]) -> Any:
    """The block under ``torch.profiler`` (CUDA activity only: CUPTI records every kernel of the process, CuPy's,
    NCCL's and each one inside a CUDA graph), the device idle at both ends, written as ``folder/<name>.trace.json``.
    A profiler that fails is noted in ``entry`` and the block runs anyway (the other ranks take the same steps)."""
    synchronize()
    prof: Any = None
    try:
        torch_profiler: Any = importlib.import_module("torch.profiler")
        prof = torch_profiler.profile(activities=[torch_profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    except Exception as exc:
        entry["profile_note"] = f"torch.profiler not started: {first_line(exc)}"
        prof = None
    try:
        yield
    finally:
        synchronize()
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
                # the file is named by the configuration (``name`` is the NVTX range's, with its prefix)
                config = name.removeprefix(PROFILE_RANGE_PREFIX)
                prof.export_chrome_trace(str(folder / f"{config}{TORCH_TRACE_SUFFIX}"))
            except Exception as exc:
                entry["profile_note"] = f"torch.profiler trace not written: {first_line(exc)}"


# -- the entry point ---------------------------------------------------------------------------------------
def worker(job_path: Path) -> int:
    """Run every configuration of the job; exit non-zero right after the first that fails (its error
    written first)."""
    job = Job.from_json(job_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and job.nsys_prefix and not os.environ.get(UNDER_NSYS_ENV):
        # rank 0 again, under nsys (same pid: the launcher still watches it); only the profiled steps are
        # captured (the CUDA profiler API starts and stops each range)
        os.environ[UNDER_NSYS_ENV] = "1"
        argv = [*job.nsys_prefix, sys.executable, str(Path(sys.argv[0]).resolve()), "--worker", str(job_path)]
        os.execvp(argv[0], argv)
    report = RankReport(job_path.parent / f"rank{rank}.json", rank)
    runner: BluTrainRank | TorchRank | None = None
    failed = False
    try:
        runner = BluTrainRank(job) if job.framework == "blutrain" else TorchRank(job)
        for c in job.configs:
            entry = report.start(c.name)
            late = job.deadline is not None and time.time() > job.deadline
            if runner.agree(late):
                entry.update(status="skipped", why="the --budget was spent before it started")
                report.write()
                continue
            try:
                runner.run(c, report, entry)
                entry["status"] = "ok"
            except TensorParallelUnavailableError as exc:  # the same on every rank: they skip it together
                entry.update(status="skipped", why=str(exc))
            except BaseException as exc:  # a configuration's failure is its row, whatever it is
                entry.update(status="error", error=first_line(exc), oom=is_out_of_memory(exc))
                print(f"rank {rank}: {c.name} failed in {entry['phase']}: {entry['error']}", file=sys.stderr,
                      flush=True)
                traceback.print_exc()
                failed = True
            report.write()
            if failed:
                break
            if rank == 0 and entry["step_ms"]:
                ms = sorted(entry["step_ms"])[len(entry["step_ms"]) // 2]
                print(f"{c.name}: rank 0 median step {ms:.2f} ms, loss {entry['losses'][0]:.4f} → "
                      f"{entry['losses'][-1]:.4f}", flush=True)
    except BaseException as exc:  # the set-up itself (process group, imports)
        report.data["error"] = first_line(exc)
        report.write()
        traceback.print_exc()
        failed = True
    if not failed and runner is not None:
        # the results are written: a process group that does not come apart in time costs no more than this
        timer = threading.Timer(TEARDOWN_S, _leave, (f"teardown did not finish within {TEARDOWN_S:g} s", 0))
        timer.daemon = True
        timer.start()
        runner.teardown()
    # no interpreter teardown either: finalizers of communicators could wait for peers that are gone
    _leave(None, WORKER_FAILED if failed else 0)
    return 0


def _leave(why: str | None, code: int) -> None:
    if why:
        print(f"rank {os.environ.get('RANK', '0')}: {why}; exiting", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
