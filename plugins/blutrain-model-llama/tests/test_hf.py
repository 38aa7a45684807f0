"""Hugging Face interop: a LlamaForCausalLM checkpoint written in Hugging Face layout by hand in this test (its
tensor names, float32 safetensors written byte by byte, single-file and sharded with an index) loads and gives
the independent float64 forward's logits within float32 tolerance; save → load is exact; a config that does
not match the weights, or a feature this model lacks, is a one-line error naming the file and key."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models import PretrainedError, model_spec
from blutrain_model_llama import Llama


def write_safetensors_by_hand(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format written out: an 8-byte little-endian header length, the JSON header (dtype,
    shape, data offsets per tensor), then the raw little-endian float32 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, value in tensors.items():
        blob = np.ascontiguousarray(value, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_hf_checkpoint(root: Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], shards: int = 1) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        write_safetensors_by_hand(root / "model.safetensors", weights)
        return
    names = list(weights)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors_by_hand(root / shard, {n: weights[n] for n in part})
        weight_map.update(dict.fromkeys(part, shard))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def f32(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as the float32 file holds them, back in float64 for the reference."""
    return {k: v.astype(np.float32).astype(np.float64) for k, v in weights.items()}


@pytest.mark.parametrize(("shards", "tied"), [(1, False), (3, False), (1, True)])
def test_a_hugging_face_checkpoint_gives_the_reference_logits(tmp_path: Path, make_hf: Any, reference: Any,
                                                              shards: int, tied: bool) -> None:
    hf_config, random_weights = make_hf
    cfg = hf_config(tie_word_embeddings=tied)
    weights = random_weights(cfg, seed=11)
    write_hf_checkpoint(tmp_path / "ckpt", cfg, weights, shards)
    model = model_spec("llama").from_pretrained(tmp_path / "ckpt")
    assert isinstance(model, Llama) and model.config.n_kv_head == 2 and model.config.tie_embeddings is tied
    ids = np.random.default_rng(5).integers(0, cfg["vocab_size"], (2, 13))
    logits, _ = model(bt.tensor(ids))
    assert logits is not None
    want = reference(cfg, f32(weights), ids)
    got = logits.detach().numpy().astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_save_then_load_is_exact(tmp_path: Path, max_shard_bytes: int | None) -> None:
    bt.manual_seed(3)
    model = Llama(model_spec("llama").config("tiny", n_layer=2, n_embd=64, ffn_hidden=96, vocab_size=100))
    model.save_pretrained(tmp_path, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes is not None:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
        assert not (tmp_path / "model.safetensors").exists()
    again = Llama.from_pretrained(tmp_path)
    assert again.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["num_key_value_heads"] == 2


def test_a_save_in_the_other_form_replaces_the_previous_one(tmp_path: Path) -> None:
    bt.manual_seed(0)
    model = Llama(model_spec("llama").config("tiny", n_layer=1, n_embd=32, ffn_hidden=32, vocab_size=40))
    model.save_pretrained(tmp_path, max_shard_bytes=5_000)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_a_config_that_does_not_fit_the_weights_is_an_error_naming_them(tmp_path: Path, make_hf: Any) -> None:
    hf_config, random_weights = make_hf
    cfg = hf_config()
    write_hf_checkpoint(tmp_path, {**cfg, "intermediate_size": 40}, random_weights(cfg))
    with pytest.raises(PretrainedError, match=r"the weights do not fit its config.json .*mlp.gate_proj.weight"):
        Llama.from_pretrained(tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "mistral"}, r"model_type is 'mistral'; the llama family reads 'llama'"),
    ({"hidden_act": "gelu"}, r"hidden_act must be 'silu'"),
    ({"attention_bias": True}, r"attention_bias=true is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling .* is not supported"),
    ({"num_key_value_heads": 3}, r"n_head \(4\) must be a multiple of n_kv_head \(3\)"),
])
def test_an_unsupported_config_is_refused(tmp_path: Path, make_hf: Any, change: dict[str, Any], message: str) -> None:
    hf_config, random_weights = make_hf
    cfg = hf_config()
    write_hf_checkpoint(tmp_path, {**cfg, **change}, random_weights(cfg))
    with pytest.raises(PretrainedError, match=message):
        Llama.from_pretrained(tmp_path)


def test_a_shard_holding_other_tensors_than_its_index_says_is_an_error(tmp_path: Path, make_hf: Any) -> None:
    hf_config, random_weights = make_hf
    cfg = hf_config()
    write_hf_checkpoint(tmp_path, cfg, random_weights(cfg), shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PretrainedError, match=r"holds other tensors than model.safetensors.index.json assigns"):
        Llama.from_pretrained(tmp_path)


def test_a_directory_without_safetensors_is_an_error(tmp_path: Path, make_hf: Any) -> None:
    hf_config, _ = make_hf
    (tmp_path / "config.json").write_text(json.dumps(hf_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(PretrainedError, match=r"neither model.safetensors nor model.safetensors.index.json"):
        Llama.from_pretrained(tmp_path)
