"""Model families are plugins: the registry, the built-in GPT-2 plugin, and a family registered at run time
that the trainer and ``blutrain generate`` build by name."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blutrain.cli import main
from blutrain.models import GPT2, PRESETS, GPT2Config, HFMapping, ModelError, ModelSpec, model_spec, models
from blutrain.tensor import plugins
from blutrain.tensor.errors import NotRegisteredError, PluginError
from blutrain.tensor.testing import plugin_registered
from blutrain.train import ConfigError, Trainer

COPY = ModelSpec(name="gpt2-copy", model_class=GPT2, config_class=GPT2Config, presets={"tiny": PRESETS["tiny"]},
                 hf=HFMapping("gpt2", "GPT2LMHeadModel"))


class _CopyPlugin:
    @plugins.hookimpl
    def blutrain_register_models(self, registry: Any) -> None:
        registry.register(COPY.name, COPY)


class _MisnamedPlugin:
    @plugins.hookimpl
    def blutrain_register_models(self, registry: Any) -> None:
        registry.register("other", COPY)


@pytest.fixture
def copy_family() -> Iterator[None]:
    with plugin_registered(_CopyPlugin(), "test-gpt2-copy"):
        yield


def test_gpt2_is_registered_by_the_builtin_plugin() -> None:
    spec = model_spec("gpt2")
    assert spec.model_class is GPT2 and spec.hf == HFMapping("gpt2", "GPT2LMHeadModel")
    assert models().provider("gpt2").plugin == "gpt2"


def test_a_preset_with_overrides_builds_the_config() -> None:
    cfg = model_spec("gpt2").config("tiny", n_layer=1)
    assert isinstance(cfg, GPT2Config) and cfg.n_layer == 1 and cfg.n_embd == PRESETS["tiny"]["n_embd"]


def test_an_unknown_preset_or_field_is_an_error_listing_what_exists() -> None:
    with pytest.raises(ModelError, match=r"unknown preset 'huge'; expected one of tiny, gpt2-124m"):
        model_spec("gpt2").config("huge")
    with pytest.raises(ModelError, match=r"model 'gpt2': .*n_layers.*its config fields are "
                                       r"block_size, checkpoint_activations, dropout"):
        model_spec("gpt2").config("tiny", n_layers=2)


def test_an_unknown_family_lists_the_installed_ones() -> None:
    with pytest.raises(NotRegisteredError, match=r"no model 'bert'; installed: gpt2 \(blutrain"):
        model_spec("bert")


def test_a_spec_registered_under_another_name_is_refused() -> None:
    with (plugin_registered(_MisnamedPlugin(), "test-misnamed-model"),
          pytest.raises(PluginError, match=r"registered as 'other' has ModelSpec.name 'gpt2-copy'")):
        models()


def test_plugins_lists_the_models(capsys: pytest.CaptureFixture[str], copy_family: None) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "blutrain_register_models: gpt2\n" in out
    assert "\ntest-gpt2-copy  [registered at run time]" in out and "blutrain_register_models: gpt2-copy" in out


def test_the_builtin_family_can_be_blocked_by_name() -> None:
    env = {**os.environ, "BLUTRAIN_DISABLE_PLUGINS": "gpt2"}
    code = "from blutrain.models import models; print(models().names())"  # other families may stay
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "gpt2" not in out.stdout and out.stdout.startswith("[")


def test_the_trainer_and_generate_build_the_family_named_by_model(copy_family: None, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from blutrain.train import TrainConfig

    cfg = TrainConfig(model="gpt2-copy", device="cpu", batch_size=2, seq_len=16, max_steps=2, warmup_steps=0,
                      eval_every=0, sample_tokens=4, out=str(tmp_path), data=None,
                      model_overrides={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16})
    trainer = Trainer(cfg)
    assert isinstance(trainer.net, GPT2)
    result = trainer.run()
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(result["checkpoint"]), "--prompt", "def", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip().startswith("def")


def test_an_unknown_model_is_a_config_error(tmp_path: Path) -> None:
    from blutrain.train import TrainConfig

    with pytest.raises(ConfigError, match=r"model: no model 'llama-9'; installed: gpt2"):
        Trainer(TrainConfig(model="llama-9", device="cpu", out=str(tmp_path)))
