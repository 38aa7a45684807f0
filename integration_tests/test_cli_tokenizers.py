"""A user's runs on the GPT-2 tokenizer and their --tokenizer mistakes, through the ``blutrain`` command.

The tokenizer file given to ``prepare`` is the one ``train`` samples with and ``generate`` decodes with
(dataset.json and every checkpoint record it); ``--tokenizer-file`` on either replaces it. ``--tokenizer``
names byte or gpt2 and must fit the data: the built-in corpus is byte-level, and a prepared directory
records its own. Every refusal is one line, leaves no run directory behind, and names only real flags.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from blutrain_cli import (
    SMALL_RUN_TOML,
    assert_flags_exist,
    blutrain,
    ok,
    one_line_error,
    tree_digest,
    write_documents,
    write_ranks_file,
)

TRAIN = ("--config", "small.toml", "--max-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0")


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's directory after prepare (gpt2, a ranks file of their own) and a two-step train on it."""
    work = tmp_path_factory.mktemp("gpt2-user")
    (work / "small.toml").write_text(SMALL_RUN_TOML)
    write_ranks_file(work / "toy.tiktoken")
    docs = write_documents(work / "text")
    ok(blutrain("prepare", *(d.relative_to(work) for d in docs), "--out", "data/g", "--tokenizer", "gpt2",
                "--tokenizer-file", "toy.tiktoken", "--val-fraction", "0.1", cwd=work))
    trained = ok(blutrain("train", "--data", "data/g", *TRAIN, "--out", "runs/g", cwd=work))
    (work / "train.out").write_text(trained.stdout)
    return work


def test_a_gpt2_run_prints_its_sample_with_the_tokenizer_file_given_to_prepare(gpt2_run: Path) -> None:
    stdout = (gpt2_run / "train.out").read_text()
    assert "--- sample ---" in stdout and "note: no sample" not in stdout, stdout
    recorded = tomllib.loads((gpt2_run / "runs/g/config.toml").read_text())
    assert recorded["tokenizer"] == "gpt2"
    assert recorded["tokenizer_file"] == str((gpt2_run / "toy.tiktoken").resolve())


def test_generate_decodes_a_gpt2_checkpoint_from_any_directory(gpt2_run: Path, tmp_path: Path) -> None:
    checkpoint = gpt2_run / "runs/g/final.safetensors"
    before = tree_digest(gpt2_run / "runs")
    out = ok(blutrain("generate", "--checkpoint", checkpoint, "--prompt", "the cat", "--max-new-tokens", "5",
                      cwd=tmp_path)).stdout
    assert out.startswith("the cat"), out
    assert tree_digest(gpt2_run / "runs") == before


def test_generate_names_a_moved_tokenizer_file_and_takes_another(gpt2_run: Path, tmp_path: Path) -> None:
    checkpoint = gpt2_run / "runs/g/final.safetensors"
    moved = tmp_path / "elsewhere.tiktoken"
    (gpt2_run / "toy.tiktoken").rename(moved)
    try:
        refused = blutrain("generate", "--checkpoint", checkpoint, "--max-new-tokens", "3", cwd=tmp_path)
        line = one_line_error(refused, "generate", str(gpt2_run / "toy.tiktoken"), "--tokenizer-file PATH")
        assert_flags_exist(line, "generate", tmp_path)
        out = ok(blutrain("generate", "--checkpoint", checkpoint, "--prompt", "the", "--max-new-tokens", "3",
                          "--tokenizer-file", moved, cwd=tmp_path)).stdout
        assert out.startswith("the"), out
    finally:
        moved.rename(gpt2_run / "toy.tiktoken")


def test_a_gpt2_glob_without_any_tokenizer_file_trains_and_says_once_why_there_is_no_sample(gpt2_run: Path) -> None:
    proc = ok(blutrain("train", "--data", "data/g/train_*.bin", "--tokenizer", "gpt2", *TRAIN, "--out", "runs/glob",
                       cwd=gpt2_run))
    assert proc.stdout.count("note: no sample at the end: ") == 1, proc.stdout
    assert "--- sample ---" not in proc.stdout
    assert (gpt2_run / "runs/glob/final.safetensors").is_file()
    note = next(line for line in proc.stdout.splitlines() if line.startswith("note: no sample"))
    assert_flags_exist(note, "train", gpt2_run)


def test_train_refuses_a_tokenizer_file_that_does_not_exist_before_writing_anything(gpt2_run: Path) -> None:
    proc = blutrain("train", "--data", "data/g", "--tokenizer-file", "gone.tiktoken", *TRAIN, "--out", "runs/gone",
                    cwd=gpt2_run)
    one_line_error(proc, "train", "gone.tiktoken: no such file")
    assert not (gpt2_run / "runs/gone").exists()


def test_an_unknown_tokenizer_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = blutrain("train", "--tokenizer", "foo", "--max-steps", "1", "--out", "runs/foo", cwd=tmp_path)
    one_line_error(proc, "train", "tokenizer must be one of byte, gpt2, got 'foo'")
    assert not (tmp_path / "runs").exists()


def test_gpt2_with_the_built_in_byte_corpus_is_refused_saying_how_to_train_on_gpt2_tokens(tmp_path: Path) -> None:
    proc = blutrain("train", "--tokenizer", "gpt2", "--max-steps", "1", "--out", "runs/gpt2", cwd=tmp_path)
    line = one_line_error(proc, "train", "tokenizer 'gpt2' does not apply to the built-in corpus",
                          "blutrain prepare", "--tokenizer gpt2", "--data DIR")
    assert_flags_exist(line.split("`blutrain prepare")[0] + line.split("`")[-1], "train", tmp_path)
    assert_flags_exist(line.split("`")[1], "prepare", tmp_path)
    assert not (tmp_path / "runs").exists()


def test_a_tokenizer_that_disagrees_with_the_prepared_data_is_refused(gpt2_run: Path) -> None:
    proc = blutrain("train", "--data", "data/g", "--tokenizer", "byte", *TRAIN, "--out", "runs/byte", cwd=gpt2_run)
    line = one_line_error(proc, "train", "tokenizer 'byte' disagrees with", "prepared with 'gpt2'",
                          "leave --tokenizer out")
    assert_flags_exist(line, "train", gpt2_run)
    assert not (gpt2_run / "runs/byte").exists()
