"""``blutrain generate``'s arguments and ``blutrain export``, called in-process through ``main``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from blutrain.cli import main
from blutrain.cli.train_command import top_k_value
from blutrain.data import get_tokenizer, prepare
from blutrain.models import GPT2
from blutrain.train import TrainConfig, Trainer, load_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final checkpoint of a one-step byte-level run of a small model."""
    root = tmp_path_factory.mktemp("run")
    (root / "doc.txt").write_text("the cat sat on the mat; " * 100)
    prepare([root / "doc.txt"], root / "data", get_tokenizer("byte"), 0.1)
    cfg = TrainConfig(data=str(root / "data"), device="cpu", batch_size=2, seq_len=16, max_steps=1, eval_every=0,
                      eval_batches=1, out=str(root / "out"), sample_tokens=4,
                      model_overrides={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32})
    return str(Trainer(cfg).run()["checkpoint"])


@pytest.mark.parametrize(("text", "value"), [("0", None), ("none", None), ("None", None), ("7", 7)])
def test_top_k_takes_a_count_or_zero_or_none_for_no_limit(text: str, value: int | None) -> None:
    assert top_k_value(text) == value


@pytest.mark.parametrize("text", ["-2", "all", "1.5"])
def test_top_k_refuses_anything_else(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive number of tokens, or 0 or none"):
        top_k_value(text)


def test_export_writes_the_checkpoints_model_in_the_hugging_face_layout(checkpoint: str, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", checkpoint, "--out", str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    model = GPT2.from_pretrained(tmp_path / "hf")
    saved = load_checkpoint(checkpoint)["model"]
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(saved[name]), err_msg=name)
    assert json.loads((tmp_path / "hf/config.json").read_text())["n_embd"] == 32


def test_export_leaves_an_existing_directory_alone_unless_told(checkpoint: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/model.safetensors").write_bytes(b"mine")
    assert main(["export", checkpoint, "--out", str(tmp_path / "hf")]) == 1
    assert "already holds model.safetensors; choose another directory or pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "hf/model.safetensors").read_bytes() == b"mine"
    assert main(["export", checkpoint, "--out", str(tmp_path / "hf"), "--overwrite"]) == 0
    assert (tmp_path / "hf/model.safetensors").read_bytes() != b"mine"


def test_generate_refuses_a_tokenizer_file_for_a_byte_checkpoint(checkpoint: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--checkpoint", checkpoint, "--device", "cpu", "--tokenizer-file", "x.tiktoken"])
    assert code == 1
    assert "trained on the byte tokenizer, which reads no file; leave --tokenizer-file out" in capsys.readouterr().err
