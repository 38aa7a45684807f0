"""``--on-nonfinite``: a NaN or infinite loss or gradient norm is caught every step; ``skip`` leaves the
update out and logs it, ``stop`` keeps a checkpoint of the last good state and fails naming the step."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered
from blutrain.train import CheckpointError, ConfigError, NonFiniteError, TrainConfig, Trainer, load_checkpoint
from blutrain.train.trainer import Trainer as TrainerClass

MakeConfig = Callable[..., TrainConfig]
# NumPy warns about the overflow these tests provoke on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _weights(trainer: Trainer) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.numpy().copy() for k, v in trainer.model.state_dict().items()}


def _optimizer_tensors(trainer: Trainer) -> list[np.ndarray[Any, Any]]:
    state = trainer.optimizer.state_dict()["state"]
    return [v.numpy().copy() for entry in state.values() for v in entry.values() if isinstance(v, bt.Tensor)]


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    @hookimpl
    def blutrain_on_train_event(self, event: str, state: dict[str, Any]) -> None:
        self.seen.append((event, dict(state)))


def test_skip_leaves_a_nan_loss_step_out_and_logs_it(make_config: MakeConfig) -> None:
    out = io.StringIO()
    trainer = Trainer(make_config(on_nonfinite="skip"), stream=out)
    trainer.train_step()
    ln_f = trainer.model.state_dict()["transformer.ln_f.weight"].numpy()
    good = ln_f[0]
    ln_f[0] = np.nan  # every position's logits become NaN
    weights, moments = _weights(trainer), _optimizer_tensors(trainer)
    events = _Events()
    with plugin_registered(events, "nonfinite-events"):
        m = trainer.train_step()
    assert m["skipped"] is True and m["step"] == 2 and math.isnan(m["loss"])
    after = _weights(trainer)
    for name, w in weights.items():
        np.testing.assert_array_equal(after[name], w, err_msg=name)  # NaN == NaN here: nothing moved
    for a, b in zip(_optimizer_tensors(trainer), moments, strict=True):
        np.testing.assert_array_equal(a, b)
    assert trainer.skipped_steps == [2] and trainer.step == 2
    assert "step 2: non-finite loss nan" in out.getvalue() and "skipped" in out.getvalue()
    assert [e for e, _ in events.seen] == ["nonfinite"] and events.seen[0][1]["step"] == 2
    ln_f[0] = good
    m = trainer.train_step()
    assert "skipped" not in m and math.isfinite(m["loss"])
    assert not np.array_equal(_weights(trainer)["transformer.h.0.attn.c_attn.weight"],
                              after["transformer.h.0.attn.c_attn.weight"])


class _OverflowingGradient(TrainerClass):
    """A step whose loss is finite but one gradient element overflows to inf."""

    overflow_at = 2

    def _accumulate(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> list[bt.Tensor]:
        losses = super()._accumulate(batches)
        if self.step + 1 == self.overflow_at:
            self.model.transformer.h[0].mlp.c_fc.weight.grad.numpy()[3, 5] = np.inf
        return losses


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_skip_catches_a_nonfinite_gradient_norm_with_a_finite_loss(make_config: MakeConfig, clip: float) -> None:
    trainer = _OverflowingGradient(make_config(on_nonfinite="skip", clip=clip), stream=io.StringIO())
    first = trainer.train_step()
    weights = _weights(trainer)
    m = trainer.train_step()
    assert math.isfinite(m["loss"]) and math.isinf(m["grad_norm"]) and m["skipped"] is True
    assert all(np.array_equal(_weights(trainer)[k], w) for k, w in weights.items())
    assert "skipped" not in first and math.isfinite(first["grad_norm"]) and first["grad_norm"] > 0


def test_stop_keeps_the_last_good_state_and_exits_non_zero_naming_the_step(
        small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from blutrain.cli import main

    common = ["train", "--data", str(small_dataset), "--device", "cpu", "--batch-size", "4", "--seq-len", "16",
              "--lr", "1e30", "--warmup-steps", "0", "--eval-every", "0", "--seed", "3", "--preset", "tiny"]
    # an AdamW step with lr 1e30 makes the second forward overflow
    code = main([*common, "--max-steps", "5", "--out", str(tmp_path / "stop"), "--on-nonfinite", "stop"])
    err = capsys.readouterr().err
    assert code == 1
    assert "step 2: non-finite loss" in err and "step_000001.safetensors" in err
    kept = load_checkpoint(tmp_path / "stop" / "step_000001.safetensors")
    assert kept["trainer"]["step"] == 1
    assert not (tmp_path / "stop" / "final.safetensors").exists()
    assert len((tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()) == 1
    # the same run, one step long, holds the same state bit for bit
    from blutrain.cli import build_parser
    from blutrain.cli.train_command import build_config

    cfg = build_config(build_parser().parse_args([*common, "--max-steps", "1", "--out", str(tmp_path / "one")]))
    one = Trainer(cfg, stream=io.StringIO())
    one.train_step()
    for name, t in one.model.state_dict().items():
        np.testing.assert_array_equal(kept["model"][name].numpy(), t.numpy(), err_msg=name)
    assert kept["loader"] == one.loader.state_dict() and kept["rng"] == one._rng_state()


def test_stop_raises_nonfinite_error_with_the_step_and_checkpoint(make_config: MakeConfig, tmp_path: Path) -> None:
    trainer = _OverflowingGradient(make_config(on_nonfinite="stop", async_checkpoint=True), stream=io.StringIO())
    trainer.train_step()
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss .*gradient norm inf") as info:
        trainer.train_step()
    assert info.value.step == 2 and info.value.checkpoint == tmp_path / "out" / "step_000001.safetensors"
    assert load_checkpoint(info.value.checkpoint)["trainer"]["step"] == 1


def test_compiled_step_stops_on_nonfinite_naming_the_step(make_config: MakeConfig) -> None:
    cfg = make_config(compile=True, lr=1e30, warmup_steps=0, max_steps=4)
    cfg.model_overrides["dropout"] = 0.0  # the compiler traces no dropout
    trainer = Trainer(cfg, stream=io.StringIO())
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite .*compiled step applies the optimizer"):
        trainer.run()


def test_skip_cannot_apply_to_the_compiled_step(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match=r"on_nonfinite 'skip' cannot apply to compile"):
        Trainer(make_config(compile=True, on_nonfinite="skip"))


def test_unknown_policy_is_named(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match=r"on_nonfinite must be 'skip' or 'stop', got 'ignore'"):
        Trainer(make_config(on_nonfinite="ignore"))


def test_skipped_steps_are_marked_in_the_metrics_and_survive_a_resume(make_config: MakeConfig,
                                                                      tmp_path: Path) -> None:
    trainer = _OverflowingGradient(make_config(on_nonfinite="skip", max_steps=3), stream=io.StringIO())
    trainer.run()
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("skipped", False) for m in lines] == [False, True, False]
    state = load_checkpoint(tmp_path / "out" / "final.safetensors")
    assert state["trainer"]["skipped_steps"] == [2]
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "out" / "missing.safetensors")
