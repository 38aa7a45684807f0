"""``blutrain generate`` as a user runs it: --top-k 0 / none, files that are not checkpoints, the KV cache."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
from blutrain_cli import blutrain, ok, one_line_error, small_trained_run, tree_digest


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level dataset and a two-step run on it, in a user's directory."""
    return small_trained_run(tmp_path_factory.mktemp("generate-user"))


def _generate(run_dir: Path, *args: str) -> str:
    return ok(blutrain("generate", "--checkpoint", "run/final.safetensors", "--prompt", "the ", "--max-new-tokens",
                       "24", "--temperature", "1.0", "--seed", "3", *args, cwd=run_dir)).stdout


def test_top_k_zero_and_none_both_mean_no_top_k(run_dir: Path) -> None:
    everything = _generate(run_dir, "--top-k", "256")  # the byte vocabulary: every token kept
    assert _generate(run_dir, "--top-k", "0") == everything
    assert _generate(run_dir, "--top-k", "none") == everything
    assert _generate(run_dir, "--top-k", "None") == everything


@pytest.mark.parametrize("value", ["-1", "ten"])
def test_a_top_k_that_is_no_count_is_refused_by_the_argument_parser(run_dir: Path, value: str) -> None:
    proc = blutrain("generate", "--checkpoint", "run/final.safetensors", "--top-k", value, cwd=run_dir)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"blutrain generate: error: argument --top-k: expected a positive number of tokens, or 0 or none for no "
        f"limit; got {value!r}")


def test_decoding_with_and_without_the_kv_cache_gives_the_same_text_for_a_seed(run_dir: Path) -> None:
    assert _generate(run_dir, "--no-cache") == _generate(run_dir)


def _not_checkpoints(directory: Path) -> dict[str, Path]:
    directory.mkdir(exist_ok=True)
    files = {"text": directory / "notes.txt", "pickle": directory / "model.pt", "short": directory / "tiny.bin"}
    files["text"].write_text("these are a user's notes, not a model\n" * 4)
    files["pickle"].write_bytes(pickle.dumps({"weights": list(range(100))}))
    files["short"].write_bytes(b"BT")
    return files


@pytest.mark.parametrize("kind", ["text", "pickle", "short"])
def test_a_file_that_is_not_a_checkpoint_is_named_as_such(run_dir: Path, tmp_path: Path, kind: str) -> None:
    path = _not_checkpoints(tmp_path)[kind]
    before = tree_digest(tmp_path)
    proc = blutrain("generate", "--checkpoint", path, cwd=run_dir)
    line = one_line_error(proc, "generate", str(path), "not a BluTrain checkpoint")
    assert not re.search(r"\d{12,}", line), line  # no header length read from text
    assert tree_digest(tmp_path) == before


def test_a_hugging_face_model_file_is_not_a_checkpoint_and_the_message_says_what_reads_it(run_dir: Path) -> None:
    ok(blutrain("export", "run/final.safetensors", "--format", "hf", "--out", "hf", cwd=run_dir))
    proc = blutrain("generate", "--checkpoint", "hf/model.safetensors", cwd=run_dir)
    one_line_error(proc, "generate", "not a BluTrain checkpoint", "--init-from DIR")
