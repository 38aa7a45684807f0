"""``blutrain train`` and ``blutrain generate``.

Flags override the ``--config`` TOML file, which overrides the defaults of
:class:`blutrain.train.TrainConfig`; every flag defaults to "not given" so that precedence holds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("model", str, "a registered model family (see `blutrain plugins`): gpt2 (default), ..."),
    ("preset", str, "the family's preset, e.g. tiny (default), gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m"),
    ("init-from", str, "start from the weights of a Hugging Face GPT-2 directory (config.json + model.safetensors, "
                       "as `blutrain export --format hf` writes); its config.json sets the architecture"),
    ("data", str, "a shard directory (from `blutrain prepare`) or a glob of .bin shards; default: built-in corpus"),
    ("tokenizer", str, "byte, gpt2 or hf:PATH (a Hugging Face tokenizer.json), for --data given as a glob (a "
                       "prepared directory records its own; the built-in corpus is byte)"),
    ("tokenizer-file", str, "gpt2's .tiktoken ranks file for the sample (default: the one the dataset records, "
                            "else tiktoken's cache)"),
    ("device", str, "auto, cpu, cuda or cuda:N"),
    ("dtype", str, "fp32, tf32 or bf16"),
    ("batch-size", int, "micro-batch size"),
    ("seq-len", int, "sequence length"),
    ("total-batch-tokens", int, "tokens per optimizer step (gradient accumulation); 0 = one micro-batch"),
    ("max-steps", int, "optimizer steps"),
    ("optimizer", str, "any registered optimizer (see `blutrain plugins`)"),
    ("lr", float, "peak learning rate"),
    ("weight-decay", float, "weight decay of 2-D parameters"),
    ("warmup-steps", int, "linear warm-up steps before cosine decay"),
    ("clip", float, "global gradient-norm clip (0 = off)"),
    ("eval-every", int, "validation every N steps (0 = only at the end)"),
    ("checkpoint-every", int, "checkpoint every N steps (0 = only at the end)"),
    ("keep", int, "keep only the N newest step checkpoints (default 3; 0 = keep all)"),
    ("on-nonfinite", str, "a NaN/inf loss or gradient norm: skip (leave the update out, log it) or stop "
                          "(keep a checkpoint of the last good state, exit non-zero); default stop"),
    ("out", str, "the run's directory (default: a new runs/YYYYmmdd-HHMMSS, linked as runs/latest; with --resume, "
                 "the checkpoint's directory); one that holds a run is refused unless resuming or --overwrite"),
    ("resume", str, "checkpoint to resume from (metrics rows after its step are dropped, then written again)"),
    ("log", lambda text: [n.strip() for n in text.split(",") if n.strip()],
     "loggers of the training events, comma separated: csv (OUT/metrics.csv), tensorboard (OUT/tensorboard/, "
     "needs blutrain-logger-tensorboard), or any installed logger plugin"),
    ("seed", int, "random seed"),
    ("parallel", str, "under `blutrain run -n N`: MODE[=VALUE][,KEY=VALUE...], ddp (VALUE: bucket MiB), "
                      "zero=STAGE (1, 2, 3) or any registered mode (see `blutrain plugins`), with the mode's options "
                      "after it (ddp,grad_dtype=bf16: gradients averaged in bf16; ddp,reduce=ordered: summed in "
                      "rank order, bit-identical to one process accumulating the ranks' micro-batches); or mesh "
                      "sizes multiplying to N: dp=2,tp=2[,async=K], dp=2,cp=2[,attn=ring|allgather|ulysses], tp=N, "
                      "cp=N, dp=N[,grad_dtype=bf16][,reduce=ordered] (ddp); async=K: async TP, each all-reduce in "
                      "K row blocks overlapping the GEMMs; zero=STAGE beside the sizes (dp=2,tp=2,zero=1): ZeRO "
                      "along dp instead of ddp"),
    ("dist-backend", str, "the process group's comm backend for --parallel: mpi or nccl (default: the one the "
                          "device's backend declares: nccl on cuda, mpi on cpu)"),
)

_SWITCHES: tuple[tuple[str, str], ...] = (
    ("compile", "trace each training step once and replay it as one compiled graph (blutrain.compiler)"),
    ("async-checkpoint", "stage checkpoints to host memory and write them on a background thread"),
    ("deterministic", "deterministic kernels (e.g. the cuda embedding backward): bit-identical losses run to run"),
    ("auto-batch", "find the largest micro-batch that fits in memory; gradient accumulation keeps the global batch"),
    ("overwrite", "replace the run already in --out: its files (metrics, checkpoints, plot) are deleted first"),
)

# on/off switches whose default is left to the library (``--remat`` / ``--no-remat``; neither: the default)
_TOGGLES: tuple[tuple[str, str], ...] = (
    ("remat", "with --compile: make cheap forward values (SwiGLU and norm outputs, bf16 weight copies) again "
              "right before the backward reads them instead of holding them (less memory, a pass over them more; "
              "the compiler's rematerialize pass); --no-remat: never; default: the compiler's default pipeline"),
)


def add_commands(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model (default: the GPT-2 tiny preset on the built-in corpus)",
                       description="Train a registered model family (--model, GPT-2 by default). With no "
                                   "arguments: the tiny preset on the interpreter's own standard library, on the "
                                   "CPU or a GPU if one is available.")
    p.add_argument("--config", type=Path, help="a TOML file of TrainConfig fields")
    for flag, kind, text in _FLAGS:
        p.add_argument(f"--{flag}", type=kind, default=None, help=text)
    for flag, text in _SWITCHES:
        p.add_argument(f"--{flag}", action="store_true", default=None, help=text)
    for flag, text in _TOGGLES:
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=text)
    p.set_defaults(func=run_train)

    g = sub.add_parser("generate", help="continue a prompt with a trained checkpoint")
    g.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint written by `blutrain train`")
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token")
    g.add_argument("--top-k", type=top_k_value, default=40, metavar="K",
                   help="sample from the K most likely tokens; 0 or none: from all (default 40)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto")
    g.add_argument("--tokenizer-file", type=Path, metavar="PATH",
                   help="gpt2's .tiktoken ranks file (default: the one the checkpoint records, else tiktoken's cache)")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token instead of decoding with a KV cache")
    g.set_defaults(func=run_generate)


def top_k_value(text: str) -> int | None:
    """``--top-k``: a positive count, or 0 / ``none`` for no top-k filtering (None)."""
    if text.strip().lower() in ("0", "none"):
        return None
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens, or 0 or none for no limit; got "
                                         f"{text!r}")
    return k


def build_config(args: argparse.Namespace) -> Any:
    from blutrain.train import TrainConfig

    cfg = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    for flag, _, _ in _FLAGS:
        name = flag.replace("-", "_")
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    for flag, _ in _SWITCHES:
        name = flag.replace("-", "_")
        if getattr(args, name, None):
            setattr(cfg, name, True)
    for flag, _ in _TOGGLES:
        name = flag.replace("-", "_")
        if getattr(args, name, None) is not None:
            setattr(cfg, name, getattr(args, name))
    return cfg


def run_train(args: argparse.Namespace) -> int:
    from blutrain.train import Trainer

    trainer = Trainer(build_config(args))
    try:
        result = trainer.run()
        # every rank: zero=3 gathers; no tokenizer (said at the start of the run): no sample
        text = (trainer.sample(trainer.cfg.prompt, trainer.cfg.sample_tokens) if trainer.tokenizer is not None
                else None)
    finally:
        if trainer.group is not None:
            from blutrain.dist import destroy_process_group

            destroy_process_group()  # the trainer's compiled step is released first (Trainer.release_compiled)
    if trainer.rank != 0:
        return 0
    if text is not None:
        print("\n--- sample ---")
        print(text)
        print("--------------")
    out = Path(trainer.cfg.out)
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'config.toml'}, {result['checkpoint']}"
          + (f", {result['plot']}" if result.get("plot") else ""))
    return 0


def checkpoint_tokenizer(train_config: dict[str, Any], tokenizer_file: Path | None, checkpoint: Path) -> Any:
    """The tokenizer a checkpoint was trained with, as its config records it (name and ranks file);
    ``tokenizer_file`` replaces the recorded ranks file (moved, or another machine)."""
    from blutrain.data import TokenizerUnavailableError, get_tokenizer
    from blutrain.train import ConfigError

    name = train_config.get("tokenizer") or "byte"
    recorded = train_config.get("tokenizer_file")
    if tokenizer_file is not None and name == "byte":
        raise ConfigError(f"--tokenizer-file {tokenizer_file}: {checkpoint} was trained on the byte tokenizer, which "
                          "reads no file; leave --tokenizer-file out")
    path = tokenizer_file if tokenizer_file is not None else recorded
    try:
        return get_tokenizer(name, path)
    except TokenizerUnavailableError as exc:
        if tokenizer_file is None and recorded is not None:
            raise ConfigError(f"{checkpoint} was trained with the {name} tokenizer read from {recorded}, which cannot "
                              f"be read now ({exc}); pass --tokenizer-file PATH") from None
        raise


def run_generate(args: argparse.Namespace) -> int:
    import blutrain.tensor as bt
    from blutrain.models import DEFAULT_MODEL, model_spec
    from blutrain.train.sharded import load_any_checkpoint
    from blutrain.train.trainer import resolve_device

    device = resolve_device(args.device)
    state = load_any_checkpoint(args.checkpoint, device=device)
    tok = checkpoint_tokenizer(state["config"].get("train", {}), args.tokenizer_file, args.checkpoint)
    spec = model_spec(state["config"]["train"].get("model", DEFAULT_MODEL))
    model: Any = spec.build(spec.config_from_dict(state["config"]["model"]))  # a Model and a blutrain.nn.Module
    model.to(device)
    model.load_state_dict(state["model"])
    ids = tok.encode(args.prompt) or [tok.eot_token]
    idx = bt.tensor([ids], dtype="int64", device=device)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         use_cache=not args.no_cache)
    print(tok.decode(out[0].tolist()))
    return 0
