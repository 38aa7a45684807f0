"""``--deterministic``: two runs on one machine give bit-identical losses; on cuda the deterministic
kernels are chosen (the sorted-segment embedding backward instead of atomics)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from blutrain.kernels import cuda as cuda_kernels
from blutrain.train import TrainConfig, Trainer

MakeConfig = Callable[..., TrainConfig]


# One process: the CLI's flags into a trainer, four steps, the losses as JSON (no evaluation, sample or plot).
_RUN = """
import json, sys
from blutrain.cli import build_parser
from blutrain.cli.train_command import build_config
from blutrain.train import Trainer
cfg = build_config(build_parser().parse_args(sys.argv[1:]))
cfg.model_overrides = {"n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1}
trainer = Trainer(cfg)
print(json.dumps([trainer.train_step()["loss"] for _ in range(4)]))
"""


def _losses(data: Path, out: Path, hash_seed: str) -> list[float]:
    args = ["train", "--deterministic", "--data", str(data), "--device", "cpu", "--batch-size", "4",
            "--seq-len", "32", "--total-batch-tokens", "256", "--out", str(out)]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-c", _RUN, *args], check=True, env=env, capture_output=True, text=True,
                          timeout=300)
    losses: list[float] = json.loads(done.stdout.splitlines()[-1])
    return losses


def test_two_deterministic_runs_give_bit_identical_losses(small_dataset: Path, tmp_path: Path) -> None:
    # separate processes with different hash seeds: nothing may depend on set or dict-of-str order
    first = _losses(small_dataset, tmp_path / "a", "1")
    second = _losses(small_dataset, tmp_path / "b", "2")
    assert len(first) == 4
    assert first == second


def test_deterministic_chooses_the_deterministic_cuda_kernels(make_config: MakeConfig) -> None:
    cuda_kernels.set_deterministic(False)
    try:
        Trainer(make_config(), stream=io.StringIO())
        assert not cuda_kernels.is_deterministic()  # without the flag the process's choice stands
        Trainer(make_config(deterministic=True), stream=io.StringIO())
        assert cuda_kernels.is_deterministic()
    finally:
        cuda_kernels.set_deterministic(True)
