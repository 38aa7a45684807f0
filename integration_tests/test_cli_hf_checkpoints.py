"""Hugging Face GPT-2 directories from the command line: ``blutrain train --init-from DIR`` starts from one
and ``blutrain export CKPT --format hf --out DIR`` writes one.

A directory written here from NumPy arrays, byte for byte as the safetensors format specifies (names
without the ``transformer.`` prefix, Conv1D weights stored (in, out), a causal-mask buffer), is the
independent reference: a run that starts from it must hold exactly its weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from blutrain_cli import (
    assert_flags_exist,
    blutrain,
    ok,
    one_line_error,
    small_trained_run,
    tree_digest,
)

from blutrain.train import load_checkpoint

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# One step at a learning rate far below every weight's float32 spacing: the run's final checkpoint then
# holds its initial weights, which is what these tests compare.
ONE_STILL_STEP = ("--max-steps", "1", "--lr", "1e-30", "--warmup-steps", "0", "--batch-size", "2", "--seq-len", "32",
                  "--eval-every", "0")
END_TOML = "sample_tokens = 8\neval_batches = 1\n"


def hf_config(n_layer: int = 1, n_head: int = 2, n_embd: int = 32, vocab_size: int = 256,
              n_positions: int = 64) -> dict[str, Any]:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": n_layer, "n_head": n_head,
            "n_embd": n_embd, "vocab_size": vocab_size, "n_positions": n_positions, "n_ctx": n_positions,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": None}


def hf_arrays(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2 weights under Hugging Face's names and layouts, drawn from ``seed`` (none exactly zero)."""
    rng = np.random.default_rng(seed)
    c, layers, vocab, positions = (int(config[k]) for k in ("n_embd", "n_layer", "vocab_size", "n_positions"))

    def draw(*shape: int, mean: float = 0.0) -> np.ndarray:
        return (mean + 0.02 * rng.standard_normal(shape) + 1e-3).astype(np.float32)

    arrays = {"wte.weight": draw(vocab, c), "wpe.weight": draw(positions, c),
              "ln_f.weight": draw(c, mean=1.0), "ln_f.bias": draw(c)}
    for i in range(layers):
        h = f"h.{i}."
        arrays |= {h + "ln_1.weight": draw(c, mean=1.0), h + "ln_1.bias": draw(c),
                   h + "attn.c_attn.weight": draw(c, 3 * c), h + "attn.c_attn.bias": draw(3 * c),
                   h + "attn.c_proj.weight": draw(c, c), h + "attn.c_proj.bias": draw(c),
                   h + "ln_2.weight": draw(c, mean=1.0), h + "ln_2.bias": draw(c),
                   h + "mlp.c_fc.weight": draw(c, 4 * c), h + "mlp.c_fc.bias": draw(4 * c),
                   h + "mlp.c_proj.weight": draw(4 * c, c), h + "mlp.c_proj.bias": draw(c),
                   h + "attn.bias": np.tril(np.ones((positions, positions), np.float32))[None, None]}
    return arrays


def write_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header padded with spaces to
    a multiple of 8, then every tensor's little-endian bytes back to back."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, a in arrays.items():
        blob = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_hf_directory(root: Path, config: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(root / "model.safetensors", arrays)
    return root


def as_blutrain_state(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What BluTrain's state dict holds for Hugging Face ``arrays``: prefixed names, Conv1D transposed,
    no mask buffers."""
    return {f"transformer.{k}": (a.T if k.endswith(CONV1D) else a) for k, a in arrays.items()
            if not k.endswith(".attn.bias")}


def assert_same_weights(model: dict[str, Any], expected: dict[str, np.ndarray]) -> None:
    assert sorted(model) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(np.asarray(model[name]), want, rtol=1e-6, atol=0, err_msg=name)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's directory: byte-level data, and a two-step run of a small model on it."""
    root = tmp_path_factory.mktemp("hf-user")
    (root / "end.toml").write_text(END_TOML)
    return small_trained_run(root)


def test_a_run_starts_from_a_hugging_face_directory_written_from_numpy(work: Path, tmp_path: Path) -> None:
    config = hf_config()
    arrays = hf_arrays(config)
    hf = write_hf_directory(tmp_path / "gpt2-numpy", config, arrays)
    before = tree_digest(hf)
    proc = ok(blutrain("train", "--config", str(work / "end.toml"), "--init-from", hf, "--data", work / "data",
                       *ONE_STILL_STEP, "--out", "run", cwd=tmp_path))
    assert f"initialised from {hf}" in proc.stdout
    state = load_checkpoint(tmp_path / "run/final.safetensors")
    assert_same_weights(state["model"], as_blutrain_state(arrays))
    assert state["config"]["model"]["n_layer"] == 1 and state["config"]["train"]["init_from"] == str(hf)
    assert tree_digest(hf) == before


def test_export_then_init_from_gives_the_same_weights(work: Path) -> None:
    exported = ok(blutrain("export", "run/final.safetensors", "--format", "hf", "--out", "exported", cwd=work))
    assert "wrote exported/config.json and exported/model.safetensors" in exported.stdout
    trained = load_checkpoint(work / "run/final.safetensors")["model"]
    config = json.loads((work / "exported/config.json").read_text())
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["vocab_size"], config["n_positions"]) == \
        (1, 2, 32, 256, 64)
    ok(blutrain("train", "--config", "end.toml", "--init-from", "exported", "--data", "data", *ONE_STILL_STEP,
                "--out", "from-exported", cwd=work))
    resumed = load_checkpoint(work / "from-exported/final.safetensors")["model"]
    assert_same_weights(resumed, {k: np.asarray(v) for k, v in trained.items()})


def test_export_refuses_to_replace_a_directory_unless_told(work: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    ok(blutrain("export", work / "run/final.safetensors", "--out", out, cwd=tmp_path))
    (out / "config.json").write_text('{"mine": true}\n')
    before = tree_digest(out)
    line = one_line_error(blutrain("export", work / "run/final.safetensors", "--out", out, cwd=tmp_path), "export",
                          "already holds config.json and model.safetensors", "--overwrite")
    assert_flags_exist(line, "export", tmp_path)
    assert tree_digest(out) == before
    ok(blutrain("export", work / "run/final.safetensors", "--out", out, "--overwrite", cwd=tmp_path))
    assert json.loads((out / "config.json").read_text())["n_layer"] == 1


def test_export_of_a_file_that_is_not_a_checkpoint_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model\n" * 10)
    one_line_error(blutrain("export", "notes.txt", "--out", "hf", cwd=tmp_path), "export", "not a BluTrain checkpoint")
    assert not (tmp_path / "hf").exists()


def _refused_train(work: Path, tmp_path: Path, hf: Path | str, *extra: str) -> str:
    proc = blutrain("train", "--config", str(work / "end.toml"), "--init-from", hf, "--data", work / "data",
                    *ONE_STILL_STEP, *extra, "--out", "run", cwd=tmp_path)
    line = one_line_error(proc, "train")
    assert not (tmp_path / "run").exists()
    return line


def test_a_preset_that_disagrees_with_config_json_is_refused(work: Path, tmp_path: Path) -> None:
    hf = write_hf_directory(tmp_path / "hf", hf_config(), hf_arrays(hf_config()))
    for preset in ("tiny", "gpt2-124m"):
        line = _refused_train(work, tmp_path, hf, "--preset", preset)
        assert f"preset '{preset}'" in line and "disagrees with" in line and "1 layers × width 32, 2 heads" in line
        assert_flags_exist(line, "train", tmp_path)


def test_a_config_json_without_gpt2_keys_is_refused_naming_them(work: Path, tmp_path: Path) -> None:
    config = {k: v for k, v in hf_config().items() if k != "n_head"}
    hf = write_hf_directory(tmp_path / "hf", config, hf_arrays(hf_config()))
    line = _refused_train(work, tmp_path, hf)
    assert "config.json: missing GPT-2 config key(s) n_head" in line


def test_weights_that_do_not_fit_config_json_are_refused(work: Path, tmp_path: Path) -> None:
    hf = write_hf_directory(tmp_path / "hf", hf_config(n_embd=32), hf_arrays(hf_config(n_embd=16)))
    line = _refused_train(work, tmp_path, hf)
    assert f"init_from {hf}" in line and "transformer.wte.weight" in line


def test_a_model_vocabulary_smaller_than_the_data_is_refused(work: Path, tmp_path: Path) -> None:
    config = hf_config(vocab_size=50)
    hf = write_hf_directory(tmp_path / "hf", config, hf_arrays(config))
    line = _refused_train(work, tmp_path, hf)
    assert "the data's vocabulary (256) is larger than the model's (50)" in line


def test_init_from_a_checkpoint_file_says_how_to_use_it(work: Path, tmp_path: Path) -> None:
    line = _refused_train(work, tmp_path, work / "run/final.safetensors")
    assert "is a file" in line and "--resume" in line and "blutrain export" in line
    assert_flags_exist(line.split("blutrain export")[0], "train", tmp_path)


def test_init_from_with_resume_is_refused(work: Path, tmp_path: Path) -> None:
    line = _refused_train(work, tmp_path, "anything", "--resume", str(work / "run/final.safetensors"))
    assert "both set the weights" in line
