"""Shared fixtures of the trainer tests: a small real dataset and a config factory for a tiny model."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from blutrain.data import get_tokenizer, prepare
from blutrain.train import TrainConfig

SMALL_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "dropout": 0.1}

MakeConfig = Callable[..., TrainConfig]


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level shards of a few real stdlib files: small, real text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("functools.py", "textwrap.py", "shlex.py", "fnmatch.py")]
    out = tmp_path_factory.mktemp("data")
    prepare(files, out, get_tokenizer("byte"), val_fraction=0.1)
    return out


@pytest.fixture
def make_config(small_dataset: Path, tmp_path: Path) -> MakeConfig:
    def make(**changes: Any) -> TrainConfig:
        cfg = TrainConfig(preset="tiny", data=str(small_dataset), device="cpu", batch_size=4, seq_len=16,
                          max_steps=6, lr=3e-3, warmup_steps=2, eval_every=0, eval_batches=2,
                          out=str(tmp_path / "out"), seed=7, model_overrides=dict(SMALL_MODEL))
        for key, value in changes.items():
            setattr(cfg, key, value)
        return cfg

    return make
