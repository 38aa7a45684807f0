"""A Hugging Face tokenizer.json through the tokenizers library: a BPE trained here on real text by that
library (nothing downloaded) encodes and decodes, names its file, prepares shards, and bad files are
refused with the file named."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from blutrain.data import HFTokenizer, PrepareReport, get_tokenizer, prepare
from blutrain.data.errors import TokenizerError, TokenizerUnavailableError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(STDLIB / "textwrap.py"), str(STDLIB / "shlex.py")], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_encode_then_decode_gives_the_text_back(tokenizer_json: Path) -> None:
    tok = get_tokenizer("hf", tokenizer_json)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 400 and tok.eot_token == 2  # "</s>"
    text = "def wrap(text, width=70):\n    return TextWrapper(width=width).wrap(text)\n"
    ids = tok.encode(text)
    assert len(ids) < 0.7 * len(text)  # merges learnt from the stdlib apply
    assert tok.decode(ids) == text


def test_its_name_records_the_file_and_builds_it_again(tokenizer_json: Path) -> None:
    tok = get_tokenizer("hf", tokenizer_json)
    assert tok.name == f"hf:{tokenizer_json.resolve()}"
    again = get_tokenizer(tok.name)
    assert again.encode("import shlex") == tok.encode("import shlex")


def test_prepare_writes_shards_that_name_the_tokenizer(tokenizer_json: Path, tmp_path: Path) -> None:
    tok = get_tokenizer("hf", tokenizer_json)
    prepare([STDLIB / "fnmatch.py"], tmp_path, tok, val_fraction=0.1)
    report = PrepareReport.read(tmp_path)
    assert report.tokenizer == tok.name and report.vocab_size == 400


def test_a_missing_or_malformed_file_or_no_end_of_text_is_an_error(tokenizer_json: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailableError, match=r"nope.json: no such file; expected a Hugging Face"):
        get_tokenizer("hf", tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"bad.json: not a Hugging Face tokenizer.json"):
        get_tokenizer("hf", bad)
    spec = json.loads(tokenizer_json.read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</s>"]
    spec["model"]["vocab"].pop("</s>")
    no_eot = tmp_path / "no_eot.json"
    no_eot.write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=r"none of </s>, <\|endoftext\|>, .* is in its vocabulary"):
        get_tokenizer("hf", no_eot)
    with pytest.raises(TokenizerError, match=r"tokenizer 'hf' needs a tokenizer.json: give its path"):
        get_tokenizer("hf")


def test_the_trainer_takes_the_vocabulary_of_an_hf_tokenizer_for_a_glob_of_shards(tokenizer_json: Path,
                                                                                   tmp_path: Path) -> None:
    from blutrain.train import TrainConfig
    from blutrain.train.trainer import resolve_data

    tok = get_tokenizer("hf", tokenizer_json)
    prepare([STDLIB / "fnmatch.py"], tmp_path, tok, val_fraction=0.1)
    data = resolve_data(TrainConfig(data=str(tmp_path / "train_*.bin"), tokenizer=tok.name))
    assert data.vocab_size == 400 and data.tokenizer == tok.name
