"""prepare: text files → train/val shards, its report, and the `prepare` subcommand."""

from __future__ import annotations

import argparse
import base64
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from blutrain.data import (
    ByteTokenizer,
    GPT2Tokenizer,
    PrepareError,
    PrepareReport,
    TokenLoader,
    add_prepare_command,
    prepare,
    read_shard,
    unigram_entropy_nats,
)

DOC_A = "def add(a, b):\n    return a + b\n"
DOC_B = "héllo wörld — ünïcode\n" * 3


@pytest.fixture
def texts(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(DOC_A, encoding="utf-8")
    b.write_text(DOC_B, encoding="utf-8")
    return [a, b]


def _stream(*docs: str) -> list[int]:
    """What the byte tokenizer's stream must be: eot (0) before each document's UTF-8 bytes."""
    return [t for doc in docs for t in [0, *doc.encode("utf-8")]]


def _read_all(paths: tuple[Path, ...]) -> list[int]:
    return [int(t) for p in paths for t in read_shard(p)]


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="blutrain")
    add_prepare_command(parser.add_subparsers())
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def test_shards_hold_the_documents_with_eot_before_each(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.0)
    assert _read_all(report.train_shards) == _stream(DOC_A, DOC_B)
    assert report.val_shards == ()


def test_the_last_val_fraction_of_tokens_becomes_validation(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.25)
    stream = _stream(DOC_A, DOC_B)
    n_val = round(len(stream) * 0.25)
    assert _read_all(report.val_shards) == stream[-n_val:]
    assert _read_all(report.train_shards) == stream[:-n_val]
    assert (report.train_tokens, report.val_tokens) == (len(stream) - n_val, n_val)


def test_splits_are_cut_into_shards_of_shard_tokens(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.2, shard_tokens=50)
    names = [p.name for p in report.train_shards]
    assert names == [f"train_{i:06d}.bin" for i in range(len(names))]
    assert [len(read_shard(p)) for p in report.train_shards[:-1]] == [50] * (len(names) - 1)
    assert 0 < len(read_shard(report.train_shards[-1])) <= 50
    assert _read_all(report.train_shards) + _read_all(report.val_shards) == _stream(DOC_A, DOC_B)


def test_report_reads_back_from_the_output_directory(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.1)
    assert PrepareReport.read(tmp_path / "out") == report


def test_report_counts_documents_and_text_bytes(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.1)
    assert report.documents == 2
    assert report.text_bytes == len(DOC_A.encode()) + len(DOC_B.encode())
    assert (report.tokenizer, report.vocab_size, report.eot_token) == ("byte", 256, 0)


def test_val_entropy_is_the_unigram_entropy_of_the_val_tokens(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.5)
    val = _read_all(report.val_shards)
    reference = -sum(c / len(val) * math.log(c / len(val)) for c in Counter(val).values())
    assert report.val_entropy_nats == pytest.approx(reference, rel=1e-12)
    assert report.val_entropy_bits == pytest.approx(reference / math.log(2), rel=1e-12)


def test_unigram_entropy_of_all_256_bytes_equally_often_is_8_bits() -> None:
    tokens = np.tile(np.arange(256), 3)
    assert unigram_entropy_nats(tokens) / math.log(2) == pytest.approx(8.0, rel=1e-12)


def test_train_shards_feed_a_token_loader(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.2)
    x, _ = TokenLoader(report.train_pattern, 2, 8, vocab_size=report.vocab_size).next_batch()
    assert x.ravel().tolist() == _stream(DOC_A, DOC_B)[:16]


def test_gpt2_tokenizer_writes_gpt2_ids_with_eot_50256(texts: list[Path], tmp_path: Path) -> None:
    ranks = tmp_path / "tiny.tiktoken"
    ranks.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    tok = GPT2Tokenizer(ranks)
    report = prepare(texts, tmp_path / "out", tok, val_fraction=0.0)
    expected = [50256, *tok.encode(DOC_A), 50256, *tok.encode(DOC_B)]
    assert _read_all(report.train_shards) == expected
    assert report.vocab_size == 50257


def test_existing_shards_in_the_output_directory_are_an_error(texts: list[Path], tmp_path: Path) -> None:
    prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.1)
    with pytest.raises(PrepareError, match=r"out already holds 2 shard\(s\).*--overwrite"):
        prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.1)


def test_overwrite_removes_stale_shards_of_an_earlier_run(texts: list[Path], tmp_path: Path) -> None:
    prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.1, shard_tokens=10)
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.1, overwrite=True)
    on_disk = sorted(p.name for p in (tmp_path / "out").glob("*.bin"))
    assert on_disk == ["train_000000.bin", "val_000000.bin"]
    assert _read_all(report.train_shards) + _read_all(report.val_shards) == _stream(DOC_A, DOC_B)


def test_non_utf8_input_is_an_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(PrepareError, match=r"latin1\.txt is not UTF-8 text: byte 0xe9 at offset 3"):
        prepare([bad], tmp_path / "out", ByteTokenizer(), val_fraction=0.1)


def test_missing_input_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match=r"input .*nope\.txt does not exist"):
        prepare([tmp_path / "nope.txt"], tmp_path / "out", ByteTokenizer(), val_fraction=0.1)


def test_val_fraction_outside_zero_to_one_is_rejected(texts: list[Path], tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match=r"val_fraction must be in \[0, 1\), received 1.0"):
        prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=1.0)


def test_prepare_command_writes_shards_prints_them_and_returns_zero(
    texts: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["prepare", *map(str, texts), "--out", str(out), "--tokenizer", "byte", "--val-fraction", "0.1"]
    assert _run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert str(out / "train_000000.bin") in printed
    assert str(out / "val_000000.bin") in printed
    assert "bits/token" in printed
    assert PrepareReport.read(out).train_tokens > 0


def test_prepare_command_prints_a_data_error_and_returns_one(
    texts: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    argv = [
        "prepare",
        str(texts[0]),
        "--out",
        str(tmp_path / "o"),
        "--tokenizer",
        "gpt2",
        "--val-fraction",
        "0",
    ]
    assert _run_cli(argv) == 1
    assert "--tokenizer-file" in capsys.readouterr().err


def test_val_fraction_zero_writes_no_validation_split(texts: list[Path], tmp_path: Path) -> None:
    report = prepare(texts, tmp_path / "out", ByteTokenizer(), val_fraction=0.0)
    assert report.val_shards == () and report.val_tokens == 0 and report.val_entropy_nats is None
    assert PrepareReport.read(tmp_path / "out").val_shards == ()
    assert "no validation split" in report.summary()


def test_the_ranks_file_is_recorded_absolute_and_read_back(texts: list[Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    monkeypatch.chdir(tmp_path)
    report = prepare(texts, Path("out"), GPT2Tokenizer("ranks.tiktoken"), val_fraction=0.1,
                     tokenizer_file="ranks.tiktoken")
    assert report.tokenizer_file == str(ranks.resolve())
    assert PrepareReport.read(tmp_path / "out").tokenizer_file == str(ranks.resolve())
    assert prepare(texts, tmp_path / "byte", ByteTokenizer(), val_fraction=0.1).tokenizer_file is None


def test_a_bad_input_creates_no_output_directory_and_keeps_existing_shards(texts: list[Path], tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match="does not exist"):
        prepare([texts[0], tmp_path / "gone.txt"], tmp_path / "new" / "out", ByteTokenizer(), val_fraction=0.1)
    assert not (tmp_path / "new").exists()
    kept = prepare(texts, tmp_path / "kept", ByteTokenizer(), val_fraction=0.1)
    before = {p.name: p.read_bytes() for p in kept.out_dir.iterdir()}
    with pytest.raises(PrepareError, match="does not exist"):
        prepare([tmp_path / "gone.txt"], tmp_path / "kept", ByteTokenizer(), val_fraction=0.1, overwrite=True)
    assert {p.name: p.read_bytes() for p in kept.out_dir.iterdir()} == before


def test_an_output_path_that_is_a_file_is_refused(texts: list[Path], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(PrepareError, match="is a file; expected a directory"):
        prepare(texts, tmp_path / "file", ByteTokenizer(), val_fraction=0.1)
    assert (tmp_path / "file").read_text() == "x"
