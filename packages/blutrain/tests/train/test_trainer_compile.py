"""``blutrain train --compile``: the compiled step trains exactly as the eager one, with ``--remat`` too."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from blutrain.cli.train_command import build_config
from blutrain.train import ConfigError, TrainConfig, Trainer


def _trainer(tmp_path: Path, compiled: bool, remat: bool | None = None) -> Trainer:
    cfg = TrainConfig(max_steps=4, batch_size=2, seq_len=32, eval_every=0, eval_batches=1, warmup_steps=2,
                      out=str(tmp_path / f"{compiled}-{remat}"), compile=compiled, remat=remat,
                      model_overrides={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32})
    return Trainer(cfg, stream=io.StringIO())


def _losses(tmp_path: Path, compiled: bool, remat: bool | None = None) -> list[float]:
    trainer = _trainer(tmp_path, compiled, remat)
    return [trainer.train_step()["loss"] for _ in range(4)]


def test_compiled_training_steps_give_the_eager_losses(tmp_path: Path) -> None:
    assert _losses(tmp_path, True) == _losses(tmp_path, False)


def test_compile_flag_sets_the_config() -> None:
    import argparse

    from blutrain.cli.train_command import add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    assert build_config(parser.parse_args(["train", "--compile"])).compile is True
    assert build_config(parser.parse_args(["train"])).compile is False


def test_remat_compiles_the_step_with_the_rematerialize_pass_and_trains_as_eager(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, True, remat=True)
    assert "rematerialize" in trainer.compiled_step.pipeline
    assert "rematerialize" not in _trainer(tmp_path, True, remat=False).compiled_step.pipeline
    assert _losses(tmp_path, True, remat=True) == _losses(tmp_path, False)


def test_remat_flags_set_the_config() -> None:
    import argparse

    from blutrain.cli.train_command import add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    assert build_config(parser.parse_args(["train", "--compile", "--remat"])).remat is True
    assert build_config(parser.parse_args(["train", "--compile", "--no-remat"])).remat is False
    assert build_config(parser.parse_args(["train", "--compile"])).remat is None


def test_remat_without_compile_is_refused() -> None:
    with pytest.raises(ConfigError, match="remat recomputes values inside the compiled step"):
        TrainConfig(remat=True).validate()
