"""The llama family from the command line, as a user runs it: shards prepared with a Hugging Face tokenizer.json
(a BPE trained here by the tokenizers library on real text), ``blutrain train --model llama`` on them,
``blutrain generate`` decoding with the tokenizer the run recorded, and ``blutrain export --format hf`` writing
a LlamaForCausalLM directory that ``from_pretrained`` loads back to the checkpoint's weights exactly; ``--init-from``
(a GPT-2 directory) refused for llama in one line."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
from blutrain_cli import blutrain, ok

from blutrain.models import model_spec
from blutrain.train import load_checkpoint

STDLIB = Path(sysconfig.get_paths()["stdlib"])
RUN = ("--model", "llama", "--max-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
       "--device", "cpu")


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(STDLIB / "textwrap.py")], trainer)
    tok.save(str(path))


def test_prepare_train_generate_and_export_a_llama_with_a_hugging_face_tokenizer(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "tokenizer.json")
    ok(blutrain("prepare", STDLIB / "textwrap.py", STDLIB / "shlex.py", "--out", "data", "--tokenizer", "hf",
                "--tokenizer-file", "tokenizer.json", "--val-fraction", "0.1", cwd=tmp_path))
    recorded = json.loads((tmp_path / "data" / "dataset.json").read_text())["tokenizer"]
    assert recorded == f"hf:{(tmp_path / 'tokenizer.json').resolve()}"
    ok(blutrain("train", *RUN, "--data", "data", "--out", "run", cwd=tmp_path))
    ckpt = tmp_path / "run" / "final.safetensors"
    state = load_checkpoint(ckpt)
    assert state["config"]["train"]["model"] == "llama" and state["config"]["model"]["vocab_size"] == 300
    out = ok(blutrain("generate", "--checkpoint", ckpt, "--prompt", "def wrap(", "--max-new-tokens", "5",
                      "--device", "cpu", cwd=tmp_path)).stdout
    assert out.startswith("def wrap(")
    ok(blutrain("export", ckpt, "--format", "hf", "--out", "hf", cwd=tmp_path))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = model_spec("llama").from_pretrained(tmp_path / "hf")
    for name, t in model.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), state["model"][name].numpy(), err_msg=name)


def test_init_from_is_refused_for_llama_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "gpt2").mkdir()
    proc = blutrain("train", *RUN, "--init-from", "gpt2", "--out", "run", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "init_from reads a Hugging Face GPT-2 directory, but model is 'llama'" in proc.stderr
