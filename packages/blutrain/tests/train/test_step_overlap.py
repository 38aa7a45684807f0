"""A step's bookkeeping (metrics.jsonl row, ``step_end`` event, progress line) is done by the next step while
that one runs on the device: every step still gets its row, in order, with the values it computed, whether
the run ends at max_steps, on a non-finite step, on a signal, on an error, or is resumed from a checkpoint."""

from __future__ import annotations

import io
import json
import math
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered
from blutrain.train import NonFiniteError, TrainConfig, TrainInterruptedError
from blutrain.train.trainer import Trainer  # the class itself, to subclass (blutrain.train's is resolved lazily)

from .conftest import MakeConfig

# what a step computes; the other fields (tok_per_s, step_ms, MFU, memory) measure the machine
COMPUTED = ("step", "loss", "lr", "grad_norm", "val_loss", "skipped")

# NumPy warns about the overflow the non-finite tests provoke on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _computed(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in COMPUTED if k in row}


def _config(make_config: MakeConfig, compiled: bool, **changes: Any) -> TrainConfig:
    cfg = make_config(compile=compiled, **changes)
    if compiled:
        cfg.model_overrides["dropout"] = 0.0  # the compiler traces no dropout
    return cfg


def _stepped(cfg: TrainConfig, steps: int) -> list[dict[str, Any]]:
    """The metrics of ``steps`` steps called one by one, outside run(): nothing is deferred there."""
    trainer = Trainer(cfg, stream=io.StringIO())
    return [_computed(trainer.train_step()) for _ in range(steps)]


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    @hookimpl
    def blutrain_on_train_event(self, event: str, state: dict[str, Any]) -> None:
        self.seen.append((event, int(state.get("step", -1))))


class _WatchedTrainer(Trainer):
    """Counts metrics.jsonl's rows when each step's batches are taken (before its launch) and when its loss
    is read back."""

    def __init__(self, cfg: TrainConfig, stream: io.StringIO) -> None:
        super().__init__(cfg, stream=stream)
        self.rows_at_launch: list[int] = []
        self.rows_at_read: list[int] = []

    def _count(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def _step_batches(self) -> list[tuple[bt.Tensor, bt.Tensor]]:
        self.rows_at_launch.append(self._count())
        return super()._step_batches()

    def _read(self, losses: list[bt.Tensor], norm: bt.Tensor) -> tuple[float, float, bool]:
        self.rows_at_read.append(self._count())
        return super()._read(losses, norm)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_each_step_has_one_row_in_order_with_the_values_it_computed(make_config: MakeConfig, tmp_path: Path,
                                                                    compiled: bool) -> None:
    cfg = _config(make_config, compiled, out=str(tmp_path / "run"), eval_every=3, checkpoint_every=4, keep=0)
    events = _Events()
    trainer = _WatchedTrainer(cfg, stream=io.StringIO())
    with plugin_registered(events, "overlap-events"):
        trainer.run()
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows == trainer.history  # the run's own metrics, as written
    alone = _stepped(_config(make_config, compiled, out=str(tmp_path / "alone")), 6)
    assert [{k: v for k, v in _computed(r).items() if k != "val_loss"} for r in rows] == alone
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert [s for e, s in events.seen if e == "step_end"] == [1, 2, 3, 4, 5, 6]
    # steps 1, 2 and 5 go straight on: their rows are written by the next step, after its launch and before
    # its loss is read; steps 3 (evaluates), 4 (checkpoints) and 6 (the last) write theirs at once
    assert trainer.rows_at_launch == [0, 0, 1, 3, 4, 4]
    assert trainer.rows_at_read == [0, 1, 2, 3, 4, 5]


def test_a_skipped_step_keeps_its_row_in_place(make_config: MakeConfig, tmp_path: Path) -> None:
    class Overflowing(Trainer):
        def _accumulate(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> list[bt.Tensor]:
            losses = super()._accumulate(batches)
            if self.step + 1 in (2, 5):
                self.model.transformer.h[0].mlp.c_fc.weight.grad.numpy()[3, 5] = np.inf
            return losses

    trainer = Overflowing(make_config(on_nonfinite="skip"), stream=io.StringIO())
    trainer.run()
    rows = _rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.get("skipped", False) for r in rows] == [False, True, False, False, True, False]
    assert rows == trainer.history


def test_an_eager_run_stopped_by_a_nonfinite_step_keeps_the_rows_before_it(make_config: MakeConfig,
                                                                           tmp_path: Path) -> None:
    class Overflowing(Trainer):
        def _accumulate(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> list[bt.Tensor]:
            losses = super()._accumulate(batches)
            if self.step + 1 == 4:
                self.model.transformer.h[0].mlp.c_fc.weight.grad.numpy()[3, 5] = np.inf
            return losses

    events = _Events()
    with plugin_registered(events, "overlap-events"), pytest.raises(NonFiniteError, match="step 4"):
        Overflowing(make_config(on_nonfinite="stop"), stream=io.StringIO()).run()
    rows = _rows(tmp_path / "out")
    assert [_computed(r) for r in rows] == _stepped(make_config(out=str(tmp_path / "alone")), 3)
    steps = [(e, s) for e, s in events.seen if e in ("step_end", "nonfinite")]
    assert steps == [("step_end", 1), ("step_end", 2), ("step_end", 3), ("nonfinite", 4)]


def test_a_compiled_run_stopped_by_a_nonfinite_step_keeps_the_rows_before_it(make_config: MakeConfig,
                                                                             tmp_path: Path) -> None:
    # an AdamW step with lr 1e30 makes the second forward overflow
    cfg = _config(make_config, True, lr=1e30, warmup_steps=0)
    with pytest.raises(NonFiniteError, match="step 2"):
        Trainer(cfg, stream=io.StringIO()).run()
    rows = _rows(tmp_path / "out")
    alone = _stepped(_config(make_config, True, lr=1e30, warmup_steps=0, out=str(tmp_path / "alone")), 1)
    assert [_computed(r) for r in rows] == alone
    assert math.isfinite(rows[0]["loss"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_run_stopped_by_a_signal_and_resumed_writes_the_uninterrupted_rows(make_config: MakeConfig,
                                                                            tmp_path: Path,
                                                                            compiled: bool) -> None:
    class SignalledAtStep3(Trainer):
        def _step_batches(self) -> list[tuple[bt.Tensor, bt.Tensor]]:
            if self.step + 1 == 3:
                signal.raise_signal(signal.SIGTERM)  # held until the step ends: the run stops after it
            return super()._step_batches()

    with pytest.raises(TrainInterruptedError) as info:
        SignalledAtStep3(_config(make_config, compiled), stream=io.StringIO()).run()
    assert info.value.step == 3
    assert [r["step"] for r in _rows(tmp_path / "out")] == [1, 2, 3]
    resumed = _config(make_config, compiled, resume=str(info.value.checkpoint))
    Trainer(resumed, stream=io.StringIO()).run()
    Trainer(_config(make_config, compiled, out=str(tmp_path / "whole")), stream=io.StringIO()).run()
    assert [_computed(r) for r in _rows(tmp_path / "out")] == [_computed(r) for r in _rows(tmp_path / "whole")]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_resumed_run_continues_the_rows_of_the_original(make_config: MakeConfig, tmp_path: Path,
                                                          compiled: bool) -> None:
    Trainer(_config(make_config, compiled, checkpoint_every=2, keep=0), stream=io.StringIO()).run()
    original = [_computed(r) for r in _rows(tmp_path / "out")]
    resumed = _config(make_config, compiled, resume=str(tmp_path / "out" / "step_000002.safetensors"))
    Trainer(resumed, stream=io.StringIO()).run()
    rows = _rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [_computed(r) for r in rows] == original


def test_a_run_broken_off_mid_step_still_writes_the_row_it_deferred(make_config: MakeConfig,
                                                                    tmp_path: Path) -> None:
    class InterruptedTwiceAtStep4(Trainer):
        def _step_batches(self) -> list[tuple[bt.Tensor, bt.Tensor]]:
            if self.step + 1 == 4:
                signal.raise_signal(signal.SIGINT)  # the first asks to stop after the step
                signal.raise_signal(signal.SIGINT)  # a second means now: KeyboardInterrupt
            return super()._step_batches()

    events = _Events()
    with plugin_registered(events, "overlap-events"), pytest.raises(KeyboardInterrupt):
        InterruptedTwiceAtStep4(make_config(), stream=io.StringIO()).run()
    rows = _rows(tmp_path / "out")
    assert [_computed(r) for r in rows] == _stepped(make_config(out=str(tmp_path / "alone")), 3)
    assert [s for e, s in events.seen if e == "step_end"] == [1, 2, 3]
