"""A run's tokenizer: what the data records, what --tokenizer may say, and what checkpoints record."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from blutrain.data import get_tokenizer, prepare
from blutrain.train import ConfigError, TrainConfig, Trainer, load_checkpoint

from .conftest import MakeConfig


def _ranks(path: Path) -> Path:
    """A GPT-2-style ranks file of the 256 single bytes only."""
    path.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    return path


def _text(path: Path) -> Path:
    path.write_text("the cat sat on the mat; " * 200)
    return path


@pytest.fixture
def gpt2_dataset(tmp_path: Path) -> Path:
    ranks = _ranks(tmp_path / "ranks.tiktoken")
    out = tmp_path / "gpt2-data"
    prepare([_text(tmp_path / "doc.txt")], out, get_tokenizer("gpt2", ranks), 0.1, tokenizer_file=ranks)
    return out


def test_an_unknown_tokenizer_is_refused() -> None:
    with pytest.raises(ConfigError, match="tokenizer must be one of byte, gpt2, got 'foo'"):
        TrainConfig(tokenizer="foo").validate()


def test_gpt2_with_the_built_in_corpus_is_refused_before_it_is_built(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match="tokenizer 'gpt2' does not apply to the built-in corpus"):
        Trainer(make_config(data=None, tokenizer="gpt2"))
    with pytest.raises(ConfigError, match="tokenizer_file does not apply to the built-in corpus"):
        Trainer(make_config(data=None, tokenizer_file="x.tiktoken"))


def test_a_tokenizer_that_disagrees_with_the_dataset_is_refused(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer 'gpt2' disagrees with .*dataset\.json: the data was "
                                          r"prepared with 'byte'"):
        Trainer(make_config(tokenizer="gpt2"))


def test_a_tokenizer_file_for_byte_data_is_refused(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match="was prepared with the byte tokenizer, which reads no file; leave "
                                          "--tokenizer-file out"):
        Trainer(make_config(tokenizer_file="ranks.tiktoken"))


def test_the_run_records_the_datasets_tokenizer_and_ranks_file(make_config: MakeConfig, gpt2_dataset: Path,
                                                                tmp_path: Path) -> None:
    trainer = Trainer(make_config(data=str(gpt2_dataset), max_steps=1, sample_tokens=4))
    result = trainer.run()
    train = load_checkpoint(result["checkpoint"])["config"]["train"]
    assert (train["tokenizer"], train["tokenizer_file"]) == ("gpt2", str((tmp_path / "ranks.tiktoken").resolve()))
    assert isinstance(trainer.sample("ab", 3), str)


def test_a_dataset_without_validation_trains_without_it(make_config: MakeConfig, tmp_path: Path) -> None:
    out = tmp_path / "noval"
    prepare([_text(tmp_path / "doc.txt")], out, get_tokenizer("byte"), 0.0)
    trainer = Trainer(make_config(data=str(out), max_steps=2, eval_every=1, seq_len=8, batch_size=2))
    assert trainer.data.val_pattern is None
    result = trainer.run()
    assert result["val_loss"] is None
