"""``--deterministic``: two runs on one machine give bit-identical losses; the device's backend is asked for
its deterministic kernels (on cuda the sorted-segment embedding backward instead of atomics)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import blutrain.tensor as bt
from blutrain.train import Trainer

from .conftest import MakeConfig

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


def test_deterministic_asks_the_device_backend_for_deterministic_kernels(make_config: MakeConfig,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # the choice is the backend's (Backend.set_deterministic: on cuda the sorted-segment embedding backward,
    # tested with the CUDA backend plugin); the trainer asks the backend of its device, and only with the flag
    backend = bt.device("cpu").backend
    calls: list[bool] = []
    monkeypatch.setattr(backend, "set_deterministic", calls.append)
    Trainer(make_config(device="cpu"), stream=io.StringIO())
    assert calls == []
    Trainer(make_config(device="cpu", deterministic=True), stream=io.StringIO())
    assert calls == [True]
