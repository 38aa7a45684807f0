"""``blutrain export CHECKPOINT --format hf --out DIR``: a checkpoint's model in the Hugging Face GPT-2 layout.

The directory gets ``config.json`` and ``model.safetensors`` as :meth:`GPT2.save_pretrained` writes them,
which ``GPT2LMHeadModel.from_pretrained``, :meth:`GPT2.from_pretrained` and ``blutrain train --init-from``
read. Only the model is exported (no optimizer or run state): the way to continue a run is ``--resume``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blutrain.tensor.errors import BluTrainError

FORMATS = ("hf",)


class ExportError(BluTrainError, ValueError):
    """The export's output directory cannot be used; the message names it and what to do."""


def add_command(sub: Any) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model in the Hugging Face GPT-2 layout",
                       description="Write the model of a `blutrain train` checkpoint as config.json + "
                                   "model.safetensors (the Hugging Face GPT-2 layout), for `blutrain train "
                                   "--init-from DIR` or GPT2LMHeadModel.from_pretrained(DIR).")
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a checkpoint written by `blutrain train`")
    p.add_argument("--format", choices=FORMATS, default="hf", help="hf: config.json + model.safetensors (default)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace config.json and model.safetensors in DIR")
    p.set_defaults(func=run)


def _check_out(out: Path, overwrite: bool) -> None:
    from blutrain.models.gpt2 import CONFIG_NAME, WEIGHTS_NAME

    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; expected a directory to write {CONFIG_NAME} and {WEIGHTS_NAME} "
                          "into; choose another path")
    held = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if (out / name).exists()]
    if held and not overwrite:
        raise ExportError(f"--out {out} already holds {' and '.join(held)}; choose another directory or pass "
                          "--overwrite to replace them")


def run(args: argparse.Namespace) -> int:
    from blutrain.models.gpt2 import GPT2, GPT2Config
    from blutrain.train.sharded import load_any_checkpoint

    out = Path(args.out)
    _check_out(out, args.overwrite)
    state = load_any_checkpoint(args.checkpoint, device="cpu")  # checks the whole file before anything is written
    model = GPT2(GPT2Config(**state["config"]["model"]))
    model.load_state_dict(state["model"])
    try:
        model.save_pretrained(out)
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write: {exc.strerror or exc}") from None
    c = model.config
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} (GPT-2, {c.n_layer} layers × width "
          f"{c.n_embd}, {c.n_head} heads, vocabulary {c.vocab_size}, {model.num_parameters():,} parameters)")
    return 0
