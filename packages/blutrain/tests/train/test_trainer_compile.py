"""``blutrain train --compile``: the compiled step trains exactly as the eager one."""

from __future__ import annotations

import io
from pathlib import Path

from blutrain.cli.train_command import build_config
from blutrain.train import TrainConfig, Trainer


def _losses(tmp_path: Path, compiled: bool) -> list[float]:
    cfg = TrainConfig(max_steps=4, batch_size=2, seq_len=32, eval_every=0, eval_batches=1, warmup_steps=2,
                      out=str(tmp_path / str(compiled)), compile=compiled,
                      model_overrides={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32})
    trainer = Trainer(cfg, stream=io.StringIO())
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
