"""``--log csv``: OUT/metrics.csv holds the rows of metrics.jsonl, and a resumed run keeps it free of duplicates."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from blutrain.train import ConfigError, TrainConfig, Trainer
from blutrain.train.csv_logger import COLUMNS

MakeConfig = Callable[..., TrainConfig]  # the make_config fixture of conftest.py


def _csv(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _jsonl(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(row: dict[str, str], metrics: dict[str, object]) -> bool:
    for column in COLUMNS:
        value = metrics.get(column)
        if value is None:
            if row[column] != "":
                return False
        elif float(row[column]) != float(value):  # type: ignore[arg-type]
            return False  # floats are written as repr: they read back exactly
    return True


def test_csv_rows_equal_the_metrics_rows(make_config: MakeConfig) -> None:
    cfg = make_config(log=["csv"], eval_every=3)
    Trainer(cfg).run()
    rows, metrics = _csv(Path(cfg.out)), _jsonl(Path(cfg.out))
    assert len(rows) == len(metrics) == cfg.max_steps
    assert all(_same(r, m) for r, m in zip(rows, metrics, strict=True))
    assert [r["step"] for r in rows if r["val_loss"]] == ["3", "6"]


def test_a_resumed_run_rewrites_the_rows_after_its_step_once(make_config: MakeConfig) -> None:
    cfg = make_config(log=["csv"], checkpoint_every=2, keep=0)
    Trainer(cfg).run()
    resumed = make_config(log=["csv"], max_steps=7, resume=str(Path(cfg.out) / "step_000002.safetensors"))
    Trainer(resumed).run()
    rows, metrics = _csv(Path(cfg.out)), _jsonl(Path(cfg.out))
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    assert all(_same(r, m) for r, m in zip(rows, metrics, strict=True))


def test_no_csv_without_log_csv(make_config: MakeConfig) -> None:
    cfg = make_config(max_steps=2)
    Trainer(cfg).run()
    assert not (Path(cfg.out) / "metrics.csv").exists()


def test_an_unknown_logger_is_a_config_error_naming_the_installed_ones(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match=r"no logger 'nope'; installed: .*csv"):
        Trainer(make_config(log=["nope"]))
