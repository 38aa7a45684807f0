"""``--log tensorboard``: a run's metrics as TensorBoard scalars, readable back from the event file."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from blutrain.data import get_tokenizer, prepare
from blutrain.train import TrainConfig, Trainer
from blutrain_logger_tensorboard import TAGS, read_scalars


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("data")
    prepare([stdlib / "textwrap.py", stdlib / "shlex.py"], out, get_tokenizer("byte"), val_fraction=0.1)
    return out


def _config(dataset: Path, out: Path, **changes: Any) -> TrainConfig:
    cfg = TrainConfig(device="cpu", data=str(dataset), batch_size=2, seq_len=16, max_steps=4, warmup_steps=1,
                      eval_every=2, eval_batches=1, out=str(out), log=["tensorboard"],
                      model_overrides={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32})
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_metric_of_every_step_is_a_scalar_in_the_event_file(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(_config(dataset, out)).run()
    scalars = read_scalars(out / "tensorboard")
    rows = _metrics(out)
    for key, tag in TAGS.items():
        expected = [(m["step"], m[key]) for m in rows if key in m]
        got = scalars.get(tag, [])
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        for (_, value), (_, want) in zip(got, expected, strict=True):
            assert math.isclose(value, want, rel_tol=1e-6), (tag, value, want)  # stored as float32
    assert [s for s, _ in scalars["val/loss"]] == [2, 4]


def test_a_run_without_log_tensorboard_writes_no_events(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(_config(dataset, out, log=[], max_steps=2)).run()
    assert not (out / "tensorboard").exists()


def test_a_resumed_run_purges_the_events_after_its_step(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(_config(dataset, out, checkpoint_every=1, keep=0, eval_every=0)).run()
    Trainer(_config(dataset, out, eval_every=0, max_steps=5, resume=str(out / "step_000002.safetensors"))).run()
    steps = [s for s, _ in read_scalars(out / "tensorboard")["train/loss"]]
    # the first file still holds steps 3 and 4 of the first run; TensorBoard hides them through the purge
    # event the resumed writer starts with, after which steps 3..5 follow once
    assert steps[-3:] == [3, 4, 5]
    losses = {m["step"]: m["loss"] for m in _metrics(out)}
    last = dict(read_scalars(out / "tensorboard")["train/loss"][-3:])
    assert all(math.isclose(last[s], losses[s], rel_tol=1e-6) for s in (3, 4, 5))


def test_a_damaged_event_file_is_reported_not_misread(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(_config(dataset, out, max_steps=2, eval_every=0)).run()
    (path,) = (out / "tensorboard").glob("events.out.tfevents.*")
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF  # one bit pattern inside the last record
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged or cut short"):
        read_scalars(out / "tensorboard")
    path.write_bytes(bytes(data[:-3]))
    with pytest.raises(ValueError, match="damaged or cut short"):
        read_scalars(out / "tensorboard")
