"""Several ``blutrain.train.Trainer`` runs of a tiny GPT-2 in one process, one after another (imports and the
launch are paid once): ``train_runs.py SPEC.json``, SPEC a list of TrainConfig overrides (``out`` among them).

Run alone for single-process runs, under ``blutrain run -n N`` for parallel ones (every rank runs the same
list in the same order, so their collectives meet). Each run writes what ``blutrain train`` writes into its
``out`` (metrics.jsonl from rank 0, checkpoints); a failing run raises, so the launch fails naming it.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

# what `blutrain train` would run with `--config` of these values; each run adds its own
BASE: dict[str, Any] = {"max_steps": 4, "seq_len": 32, "warmup_steps": 1, "eval_every": 0, "eval_batches": 1,
                        "sample_tokens": 2, "clip": 1.0, "device": "cpu",
                        "model_overrides": {"n_layer": 2, "n_head": 2, "n_embd": 32}}


def train(overrides: dict[str, Any]) -> None:
    from blutrain.train import TrainConfig, Trainer

    cfg = TrainConfig.from_dict({**BASE, **overrides}, "train_runs")
    Trainer(cfg, stream=io.StringIO()).run()


def main() -> int:
    for overrides in json.loads(Path(sys.argv[1]).read_text()):
        train(overrides)
    from blutrain import dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
