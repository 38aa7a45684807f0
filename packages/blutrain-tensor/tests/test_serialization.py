"""safetensors files: every dtype round-trips, writes are atomic, malformed files are named errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor.serialization import SerializationError, load_file, load_metadata, save_file


def test_every_dtype_and_a_non_contiguous_view_round_trip(tmp_path: Path) -> None:
    tensors = {d.name: bt.arange(6).reshape(2, 3).to(dtype=d) for d in bt.ALL_DTYPES}
    tensors["view"] = bt.arange(12, dtype="float32").reshape(3, 4)[:, ::2]
    tensors["scalar"] = bt.tensor(2.5)
    save_file(tensors, tmp_path / "m.safetensors", metadata={"step": "7"})
    back = load_file(tmp_path / "m.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype is t.dtype and back[name].shape == t.shape
        np.testing.assert_array_equal(back[name].numpy(), t.numpy())
    assert load_metadata(tmp_path / "m.safetensors") == {"step": "7"}


def test_the_header_follows_the_safetensors_format(tmp_path: Path) -> None:
    save_file({"w": bt.ones(2, dtype="bfloat16")}, tmp_path / "w.safetensors")
    raw = (tmp_path / "w.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header["w"] == {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}


def test_a_failed_write_leaves_no_file_behind(tmp_path: Path) -> None:
    with pytest.raises(SerializationError, match="'bad' is a list, not a Tensor"):
        save_file({"ok": bt.ones(1), "bad": [1.0]}, tmp_path / "x.safetensors")  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"w": bt.ones(10)}, path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(SerializationError, match=r"t.safetensors: tensor 'w' occupies bytes \[0, 40\)"):
        load_file(path)


def test_a_file_that_is_not_safetensors_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{abc}")
    with pytest.raises(SerializationError, match="header is not valid JSON"):
        load_file(path)
