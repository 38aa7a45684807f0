"""``blutrain prepare`` as a user runs it: a dataset without a validation split trains, and a bad input
leaves nothing behind (no new directory, no lost shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from blutrain_cli import SMALL_RUN_TOML, blutrain, ok, one_line_error, tree_digest, write_documents


def test_a_dataset_prepared_without_validation_trains_and_says_so_once(tmp_path: Path) -> None:
    (tmp_path / "small.toml").write_text(SMALL_RUN_TOML)
    docs = write_documents(tmp_path / "text")
    prepared = ok(blutrain("prepare", *docs, "--out", "data/noval", "--tokenizer", "byte", "--val-fraction", "0",
                           cwd=tmp_path))
    assert "no validation split" in prepared.stdout
    assert json.loads((tmp_path / "data/noval/dataset.json").read_text())["val_shards"] == []
    proc = ok(blutrain("train", "--config", "small.toml", "--data", "data/noval", "--max-steps", "4",
                       "--batch-size", "2", "--seq-len", "32", "--eval-every", "2", "--out", "runs/noval",
                       cwd=tmp_path))
    assert proc.stdout.count("has no validation split; training without validation") == 1, proc.stdout
    assert "validation loss" not in proc.stdout
    metrics = [json.loads(line) for line in (tmp_path / "runs/noval/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and not any("val_loss" in m for m in metrics)
    assert (tmp_path / "runs/noval/final.safetensors").is_file()


def _bad_input(kind: str, directory: Path) -> Path:
    """An input ``prepare`` must refuse: a missing file, a directory, a file that is not UTF-8."""
    if kind == "missing":
        return directory / "missing.txt"
    if kind == "directory":
        return directory
    path = directory / "latin1.txt"
    path.write_bytes(b"caf\xe9")
    return path


@pytest.mark.parametrize(("kind", "says"), [("missing", "does not exist"),
                                            ("directory", "is a directory; pass the text files in it"),
                                            ("not-utf8", "is not UTF-8 text")])
def test_a_bad_input_leaves_no_output_directory_behind(tmp_path: Path, kind: str, says: str) -> None:
    good = write_documents(tmp_path / "text", count=1)
    proc = blutrain("prepare", good[0], _bad_input(kind, tmp_path / "text"), "--out", "new/data", "--tokenizer",
                    "byte", "--val-fraction", "0.1", cwd=tmp_path)
    one_line_error(proc, "prepare", says)
    assert not (tmp_path / "new").exists()


def test_a_bad_input_into_an_existing_dataset_loses_none_of_its_shards(tmp_path: Path) -> None:
    docs = write_documents(tmp_path / "text", count=2)
    ok(blutrain("prepare", *docs, "--out", "data", "--tokenizer", "byte", "--val-fraction", "0.1", cwd=tmp_path))
    before = tree_digest(tmp_path / "data")
    proc = blutrain("prepare", docs[0], "missing.txt", "--out", "data", "--tokenizer", "byte", "--val-fraction",
                    "0.1", "--overwrite", cwd=tmp_path)
    one_line_error(proc, "prepare", "missing.txt does not exist")
    assert tree_digest(tmp_path / "data") == before


def test_an_output_path_that_is_a_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    docs = write_documents(tmp_path / "text", count=1)
    (tmp_path / "notes.txt").write_text("mine\n")
    proc = blutrain("prepare", *docs, "--out", "notes.txt", "--tokenizer", "byte", "--val-fraction", "0.1",
                    cwd=tmp_path)
    one_line_error(proc, "prepare", "--out notes.txt is a file")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
