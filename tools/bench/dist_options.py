"""tools/bench/dist.py's command line: the options, their defaults on each device and for each model family,
and the checks that turn a mistake into one line naming the option. Also the visible GPUs (nvidia-smi)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.arguments import choice_list
from bench.dist_report import DEFAULT_MODES, FRAMEWORKS, IMPLS, MODES, STAGES, TORCH_MODES

from blutrain.models import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]
# The GPU defaults of the default family (GPT-2 124M: issue 21's shape). Another family names its --preset; its
# micro-batch defaults to OTHER_BATCH × min(block_size, OTHER_SEQ_LEN) tokens per GPU.
GPT2_PRESET, GPT2_BATCH, GPT2_SEQ_LEN = "gpt2-124m", 16, 1024
OTHER_BATCH, OTHER_SEQ_LEN = 4, 2048
BATCH_HELP = (f"micro-batch per GPU (default on cuda: {GPT2_BATCH} for gpt2; {OTHER_BATCH} for another family: at T "
              f"{OTHER_SEQ_LEN}, Llama-1B on one 80 GB GPU in both frameworks, by estimate, not measurement: its "
              "~1.1 B parameters' float32 weights, gradients and AdamW moments take ~18 GB unsharded and the bf16 "
              "activations and logits of 4 x 2048 tokens ~25 GB in PyTorch eager; 8 would double the latter, too "
              "close to 80 GB for the eager rows. 4 on cpu)")


def gpu_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... up to ``gpus``, and ``gpus`` itself."""
    sizes, n = [], 1
    while n <= gpus:
        sizes.append(n)
        n *= 2
    return sorted({*sizes, gpus})


def gpu_names() -> list[str]:
    """The visible GPUs' names (nvidia-smi, as CUDA_VISIBLE_DEVICES leaves them), without a CUDA context here."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
        names = {int(i): n.strip() for i, n in (line.split(",", 1) for line in out.splitlines() if "," in line)}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            ids = [int(x) for x in visible.split(",") if x.strip().isdigit()]
            return [names[i] for i in ids if i in names]
        return [names[i] for i in sorted(names)]
    return []


def count_gpus() -> int:
    """The visible GPUs: nvidia-smi's list, else CUDA's count through CuPy (no context is made)."""
    names = gpu_names()
    if names:
        return len(names)
    with contextlib.suppress(Exception):
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    return 0


def torch_families() -> tuple[str, ...]:
    """The families tools/bench/gpt2.py has a PyTorch implementation of (its ``TORCH_MODELS``), which the
    PyTorch ranks train; read without importing PyTorch."""
    bench_gpt2: Any = importlib.import_module("bench.gpt2")
    return tuple(bench_gpt2.TORCH_MODELS)


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts such as 1,2,4, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected GPU counts >= 1 such as 1,2,4, got {text!r}")
    return sizes


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gpus", type=int, help="G: the most GPUs (CPU ranks) of a run (default: every visible GPU; "
                                             "2 ranks on cpu)")
    ap.add_argument("--sizes", type=_sizes, help="GPU counts to run (default 1, 2, 4, ... up to G, and G)")
    ap.add_argument("--stages", type=choice_list(STAGES), default=list(STAGES), help="default scaling,equivalence")
    ap.add_argument("--frameworks", type=choice_list(FRAMEWORKS),
                    help="default blutrain,torch (blutrain alone for a family tools/bench/gpt2.py has no PyTorch "
                         "implementation of)")
    ap.add_argument("--impls", type=choice_list(IMPLS), default=list(IMPLS), help="default eager,compiled (scaling)")
    ap.add_argument("--modes", type=choice_list(MODES), default=list(DEFAULT_MODES),
                    help="BluTrain's modes on N > 1 GPUs (default ddp,zero1,zero2,zero3; ddp-bf16: "
                         "--parallel ddp,grad_dtype=bf16, gradients reduced in bf16; tp, tp-async: --parallel "
                         "tp=N and tp=N,async=4, every rank on the same rows, efficiency = speed-up / N; "
                         "ddp-ordered: --parallel ddp,reduce=ordered, each bucket summed over the ranks in rank "
                         "order)")
    ap.add_argument("--torch-modes", type=choice_list(TORCH_MODES), default=["ddp"],
                    help="PyTorch's (default ddp; zero1 = DDP + ZeroRedundancyOptimizer, zero2/zero3 = FSDP "
                         "SHARD_GRAD_OP/FULL_SHARD, fsdp2 = fully_shard per block and the root, bf16 through "
                         "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32), compiled per block "
                         "before sharding: BluTrain zero3's counterpart; tp = DTensor parallelize_module over "
                         "every rank in the Megatron layout, every rank on the same rows (gpt2 only); tp-async = "
                         "the same sequence-parallel with inductor's micro-pipeline TP, compiled on cuda only)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a registered BluTrain model family (default gpt2; see "
                                                    "`blutrain plugins`); PyTorch trains tools/bench/gpt2.py's "
                                                    "implementation of the same family")
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), help="default bf16 (cuda), fp32 (cpu)")
    ap.add_argument("--preset", help=f"the family's preset (default on cuda {GPT2_PRESET} for gpt2, required for "
                                     "another family; the family's default, tiny, on cpu)")
    ap.add_argument("--batch-size", type=int, help=BATCH_HELP)
    ap.add_argument("--seq-len", type=int, help=f"T (default on cuda {GPT2_SEQ_LEN} for gpt2, for another family "
                                                f"{OTHER_SEQ_LEN} or the preset's block_size if smaller; 64 on cpu)")
    ap.add_argument("--steps", type=int, help="timed steps (default 20 on cuda, 3 on cpu)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default 3: compiled runs eagerly, traces, replays)")
    ap.add_argument("--equiv-steps", type=int, help="steps of the equivalence runs (default 50 on cuda, 4 on cpu)")
    ap.add_argument("--equiv-lr-warmup", type=int, default=10,
                    help="steps of linear learning-rate warm-up in the equivalence runs, both frameworks (default 10: "
                         "without it the loss spikes in the first steps and float32 rounding grows chaotically)")
    ap.add_argument("--profile", action="store_true",
                    help="exposed communication and a per-kernel table per step, from rank 0's profiled steps")
    ap.add_argument("--profiler", choices=("torch", "nsys"),
                    help="--profile's source: torch.profiler (default where PyTorch is installed) or nsys")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps profiled after the timed ones (default 3)")
    ap.add_argument("--data", help="token shards (a prepared directory or a glob); default the stdlib corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, help="seconds the whole run may take; configurations that would start "
                                                 "later are skipped (default 480 on cuda, none on cpu; 0: none)")
    ap.add_argument("--config-timeout", type=float,
                    help="seconds one configuration may take, build and compile included (default 180 on cuda for "
                         "gpt2, 300 for another family, whose 1B-parameter preset takes longer to build and "
                         "compile; 300 on cpu)")
    ap.add_argument("--out", help="output folder (default $OUT/bench_dist when OUT is set, else "
                                  "tools/results/bench_dist)")
    return ap


def parse_args(argv: list[str] | None = None, gpus_found: Callable[[], int] | None = None,
               description: str = "") -> argparse.Namespace:
    """The options, with the device's and the family's defaults filled in; ``gpus_found`` counts the visible
    GPUs (cuda). A mistake exits through ``argparse``'s one-line error."""
    ap = parser(description)
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    family = model_family(ap, a)
    found = 0 if cpu else (gpus_found or count_gpus)()
    a.gpus_found = found
    if a.gpus is None:
        a.gpus = 2 if cpu else max(found, 1)
    a.precision = a.precision or ("fp32" if cpu else "bf16")
    a.steps = a.steps or (3 if cpu else 20)
    a.warmup = a.warmup if a.warmup is not None else 3
    a.equiv_steps = a.equiv_steps or (4 if cpu else 50)
    a.budget = (0 if cpu else 480) if a.budget is None else a.budget
    a.config_timeout = a.config_timeout or (180 if not cpu and a.model == DEFAULT_MODEL else 300)
    a.out = a.out or (str(Path(os.environ["OUT"]) / "bench_dist") if os.environ.get("OUT") else
                      str(ROOT / "tools" / "results" / "bench_dist"))
    shape(ap, a, family)
    for name in ("gpus", "batch_size", "seq_len", "steps", "equiv_steps", "profile_steps"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}; give a count >= 1")
    if a.warmup < 1:
        ap.error(f"--warmup must be >= 1 (the memory peak is taken over the warm-up), got {a.warmup}")
    if a.budget < 0 or a.config_timeout <= 0:
        ap.error(f"--budget must be >= 0 and --config-timeout > 0 seconds, got {a.budget:g} and {a.config_timeout:g}")
    a.sizes = a.sizes or gpu_sizes(a.gpus)
    if cpu:
        a.gpus_found = max(a.sizes)  # CPU ranks: as many as asked
    if not cpu and found and max(a.sizes) > found:
        ap.error(f"--gpus/--sizes ask for {max(a.sizes)} GPUs but {found} are visible; give --gpus {found} or less")
    return a


def model_family(ap: argparse.ArgumentParser, a: argparse.Namespace) -> Any:
    """``--model``'s registered family (its ModelSpec); fills ``--frameworks`` by whether PyTorch has it."""
    from blutrain.models import model_spec
    from blutrain.tensor import NotRegisteredError

    try:
        family = model_spec(a.model)
    except NotRegisteredError as exc:
        ap.error(f"--model: {exc}")
    theirs = torch_families()
    if a.frameworks is None:
        a.frameworks = list(FRAMEWORKS) if a.model in theirs else ["blutrain"]
    elif "torch" in a.frameworks and a.model not in theirs:
        ap.error(f"--frameworks torch: tools/bench/gpt2.py has PyTorch implementations of {', '.join(theirs)}, not "
                 f"of {a.model!r}; give --frameworks blutrain")
    return family


def shape(ap: argparse.ArgumentParser, a: argparse.Namespace, family: Any) -> None:
    """``--preset``, ``--seq-len`` and ``--batch-size`` of the family, checked against its presets."""
    cpu, default_family = a.device == "cpu", a.model == DEFAULT_MODEL
    if a.preset is None:
        if not cpu and not default_family:
            ap.error(f"--preset: give the preset of {a.model} to run on the GPUs, one of {', '.join(family.presets)}")
        a.preset = family.default_preset if cpu else GPT2_PRESET
    if a.preset not in family.presets:
        ap.error(f"--preset: unknown preset {a.preset!r} of {a.model}; expected one of {', '.join(family.presets)}")
    block = int(family.presets[a.preset]["block_size"])
    a.seq_len = a.seq_len or (64 if cpu else GPT2_SEQ_LEN if default_family else min(OTHER_SEQ_LEN, block))
    a.batch_size = a.batch_size or (4 if cpu else GPT2_BATCH if default_family else OTHER_BATCH)
    if a.seq_len > block:
        ap.error(f"--seq-len {a.seq_len} exceeds preset {a.preset}'s block_size {block}; give --seq-len {block} "
                 "or less")


__all__ = ["count_gpus", "gpu_names", "gpu_sizes", "parse_args", "parser"]
