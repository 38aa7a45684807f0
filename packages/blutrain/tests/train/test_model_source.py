"""Where a run's model comes from: a preset, or --init-from a Hugging Face GPT-2 directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config
from blutrain.train import ConfigError, TrainConfig, Trainer, load_checkpoint

from .conftest import MakeConfig

HF_SIZE = GPT2Config(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=256)


@pytest.fixture
def pretrained(tmp_path: Path) -> tuple[Path, GPT2]:
    bt.manual_seed(3)
    model = GPT2(HF_SIZE)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def test_a_run_from_a_pretrained_directory_starts_with_its_weights_and_architecture(
        make_config: MakeConfig, pretrained: tuple[Path, GPT2]) -> None:
    root, model = pretrained
    trainer = Trainer(make_config(preset=None, init_from=str(root), model_overrides={}))
    assert trainer.model_config == HF_SIZE
    want = model.state_dict()
    got = trainer.net.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


def test_the_checkpoint_of_such_a_run_records_its_source_and_architecture(
        make_config: MakeConfig, pretrained: tuple[Path, GPT2]) -> None:
    root, _ = pretrained
    result = Trainer(make_config(preset=None, init_from=str(root), model_overrides={}, max_steps=1)).run()
    config = load_checkpoint(result["checkpoint"])["config"]
    assert config["train"]["init_from"] == str(root) and config["train"]["preset"] is None
    assert config["model"] == HF_SIZE.to_dict()


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m"])
def test_a_preset_of_another_size_is_refused(make_config: MakeConfig, pretrained: tuple[Path, GPT2],
                                             preset: str) -> None:
    root, _ = pretrained
    with pytest.raises(ConfigError, match=rf"preset '{preset}' \(.*\) disagrees with .*config\.json \(1 layers × "
                                          r"width 32, 2 heads\); leave --preset out"):
        Trainer(make_config(preset=preset, init_from=str(root), model_overrides={}))


def test_a_preset_of_the_same_size_is_accepted(make_config: MakeConfig, tmp_path: Path) -> None:
    root = tmp_path / "hf-tiny"
    bt.manual_seed(0)
    GPT2(GPT2Config.preset("tiny", n_layer=4)).save_pretrained(root)
    trainer = Trainer(make_config(preset="tiny", init_from=str(root), model_overrides={}))
    assert trainer.model_config.n_layer == 4


def test_model_overrides_that_would_reshape_the_weights_are_refused_and_others_apply(
        make_config: MakeConfig, pretrained: tuple[Path, GPT2]) -> None:
    root, _ = pretrained
    with pytest.raises(ConfigError, match=r"model_overrides n_layer=2 \(config.json: 1\) would change the shapes"):
        Trainer(make_config(preset=None, init_from=str(root), model_overrides={"n_layer": 2, "dropout": 0.1}))
    trainer = Trainer(make_config(preset=None, init_from=str(root), model_overrides={"n_layer": 1, "dropout": 0.1}))
    assert trainer.model_config.dropout == 0.1


def test_a_config_json_that_is_not_gpt2_is_refused_naming_the_directory(make_config: MakeConfig,
                                                                         pretrained: tuple[Path, GPT2]) -> None:
    root, _ = pretrained
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"activation_function": "relu"}))
    with pytest.raises(ConfigError, match=rf"init_from {root}: .*activation_function must be one of"):
        Trainer(make_config(preset=None, init_from=str(root), model_overrides={}))


def test_a_missing_directory_and_a_file_are_refused_saying_what_to_give(make_config: MakeConfig,
                                                                        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such directory; expected a Hugging Face GPT-2 directory"):
        Trainer(make_config(init_from=str(tmp_path / "gone")))
    (tmp_path / "final.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"is a file; .*give --resume; .*blutrain export"):
        Trainer(make_config(init_from=str(tmp_path / "final.safetensors")))


def test_init_from_with_resume_is_refused() -> None:
    with pytest.raises(ConfigError, match="both set the weights"):
        TrainConfig(init_from="hf", resume="final.safetensors").validate()
