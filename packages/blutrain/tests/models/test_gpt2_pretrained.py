"""The Hugging Face layout: save_pretrained / from_pretrained, and files written the way HF writes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from blutrain.models import GPT2, GPT2Config, PretrainedError
from blutrain.nn import StateDictError
from blutrain.tensor import Tensor, from_numpy, manual_seed
from blutrain.tensor.serialization import load_file, load_metadata, save_file

CFG = GPT2Config(n_layer=2, n_head=2, n_embd=16, block_size=12, vocab_size=50)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _model(seed: int = 0) -> GPT2:
    manual_seed(seed)
    return GPT2(CFG)


def _logits(m: GPT2) -> np.ndarray:
    idx = from_numpy(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 12), dtype=np.int64))
    logits, _ = m(idx)
    return np.asarray(logits.detach())


def _hf_config() -> dict[str, object]:
    return {"model_type": "gpt2", "n_embd": CFG.n_embd, "n_layer": CFG.n_layer, "n_head": CFG.n_head,
            "vocab_size": CFG.vocab_size, "n_positions": CFG.block_size, "n_ctx": CFG.block_size,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": None}


def test_save_then_load_gives_identical_logits(tmp_path: Path) -> None:
    m = _model()
    m.save_pretrained(tmp_path)
    loaded = GPT2.from_pretrained(tmp_path)
    assert loaded.config == m.config
    np.testing.assert_array_equal(_logits(loaded), _logits(m))


def test_saved_files_use_the_hugging_face_names_and_layout(tmp_path: Path) -> None:
    m = _model()
    m.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    sizes = (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["vocab_size"], cfg["n_positions"])
    assert sizes == (16, 2, 2, 50, 12)
    assert load_metadata(tmp_path / "model.safetensors") == {"format": "pt"}
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert all(name.startswith("transformer.") for name in tensors)
    c_attn = tensors["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.shape == (16, 48)  # Conv1D: (in, out)
    ours = np.asarray(m.transformer.h[0].attn.c_attn.weight.detach())
    np.testing.assert_array_equal(np.asarray(c_attn), ours.T)
    assert tensors["transformer.h.1.mlp.c_fc.weight"].shape == (16, 64)


def _write_hf_style(directory: Path, m: GPT2, prefix: str, with_buffers: bool, with_head: bool) -> None:
    """Write ``m``'s weights as Hugging Face does: Conv1D weights stored transposed, optional
    ``transformer.`` prefix, causal-mask buffers, a tied ``lm_head.weight``."""
    tensors: dict[str, Tensor] = {}
    for name, t in m.state_dict().items():
        short = name.removeprefix("transformer.")
        arr = np.asarray(t)
        if short.endswith(CONV1D):
            arr = np.ascontiguousarray(arr.T)
        tensors[prefix + short] = from_numpy(arr.copy())
    if with_buffers:
        mask = np.tril(np.ones((CFG.block_size, CFG.block_size), dtype=np.float32))[None, None]
        for i in range(CFG.n_layer):
            tensors[f"{prefix}h.{i}.attn.bias"] = from_numpy(mask.copy())
            tensors[f"{prefix}h.{i}.attn.masked_bias"] = from_numpy(np.array(-1e4, dtype=np.float32))
    if with_head:
        tensors["lm_head.weight"] = from_numpy(np.asarray(m.transformer.wte.weight.detach()).copy())
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(_hf_config()))


@pytest.mark.parametrize(("prefix", "with_buffers", "with_head"),
                         [("", True, False), ("transformer.", False, True), ("transformer.", True, True)])
def test_a_hugging_face_file_loads_to_the_same_logits(tmp_path: Path, prefix: str, with_buffers: bool,
                                                      with_head: bool) -> None:
    reference = _model(seed=1)
    _write_hf_style(tmp_path, reference, prefix, with_buffers, with_head)
    loaded = GPT2.from_pretrained(tmp_path)
    np.testing.assert_array_equal(_logits(loaded), _logits(reference))


def test_weights_set_directly_equal_the_loaded_hugging_face_file(tmp_path: Path) -> None:
    # Build the HF file from raw arrays (Conv1D layout), then set a model's weights by hand from the
    # same arrays in Linear layout: both must compute the same logits.
    rng = np.random.default_rng(7)
    direct = _model(seed=2)
    hf: dict[str, Tensor] = {}
    for name, p in direct.named_parameters():
        arr = rng.normal(0, 0.1, size=p.shape).astype(np.float32)
        p.detach().copy_(from_numpy(arr))
        short = name.removeprefix("transformer.")
        hf[short] = from_numpy(np.ascontiguousarray(arr.T) if short.endswith(CONV1D) else arr)
    save_file(hf, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(_hf_config()))
    np.testing.assert_array_equal(_logits(GPT2.from_pretrained(tmp_path)), _logits(direct))


def _write_damaged(directory: Path, damage: Callable[[dict[str, Tensor]], object], prefix: str = "",
                   with_head: bool = False) -> None:
    """Write ``_model()``'s weights Hugging Face style, then write the file again with ``damage`` done to them."""
    _write_hf_style(directory, _model(), prefix, False, with_head)
    tensors = load_file(directory / "model.safetensors")
    damage(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_an_untied_head_is_refused(tmp_path: Path) -> None:
    _write_damaged(tmp_path, lambda t: t.update({"lm_head.weight": from_numpy(np.asarray(t["lm_head.weight"]) + 1)}),
                   prefix="transformer.", with_head=True)
    with pytest.raises(PretrainedError, match=r"lm_head\.weight differs from the token embedding"):
        GPT2.from_pretrained(tmp_path)


def test_a_missing_weight_is_named(tmp_path: Path) -> None:
    _write_damaged(tmp_path, lambda t: t.pop("h.1.ln_2.bias"))
    with pytest.raises(StateDictError, match=r"missing keys: transformer.h.1.ln_2.bias"):
        GPT2.from_pretrained(tmp_path)


def test_a_conv1d_weight_in_linear_layout_is_a_shape_error(tmp_path: Path) -> None:
    c_fc = "h.0.mlp.c_fc.weight"
    _write_damaged(tmp_path, lambda t: t.update({c_fc: from_numpy(np.asarray(t[c_fc]).T.copy())}))
    with pytest.raises(StateDictError, match=r"'transformer.h.0.mlp.c_fc.weight': expected shape \[64, 16\], "
                                             r"got \[16, 64\]"):
        GPT2.from_pretrained(tmp_path)


def test_config_problems_are_named(tmp_path: Path) -> None:
    with pytest.raises(PretrainedError, match=r"config\.json: not found"):
        GPT2.from_pretrained(tmp_path)
    cfg = _hf_config()
    del cfg["n_positions"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PretrainedError, match="missing GPT-2 config key\\(s\\) n_positions"):
        GPT2.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_hf_config(), "activation_function": "relu"}))
    with pytest.raises(PretrainedError, match="activation_function must be one of"):
        GPT2.from_pretrained(tmp_path)


def test_pickle_checkpoints_are_not_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_hf_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(PretrainedError, match="safetensors only"):
        GPT2.from_pretrained(tmp_path)


def test_from_pretrained_applies_config_overrides(tmp_path: Path) -> None:
    _model().save_pretrained(tmp_path)
    loaded = GPT2.from_pretrained(tmp_path, dropout=0.1, checkpoint_activations=True)
    assert loaded.config.dropout == 0.1 and loaded.config.checkpoint_activations


@pytest.mark.parametrize("offsets", ["[0, 4]", "5", "[]", "{\"0\": 1}", "[0, 1e400]"])
def test_a_malformed_weights_file_is_a_pretrained_error_naming_it(tmp_path: Path, offsets: str) -> None:
    from blutrain.tensor import SerializationError

    _model().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    head = json.dumps(header).replace(json.dumps(header[name]["data_offsets"]), offsets, 1).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
    with pytest.raises(PretrainedError, match=r"model\.safetensors: tensor .* data_offsets") as info:
        GPT2.from_pretrained(tmp_path)
    assert isinstance(info.value.__cause__, SerializationError)
