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


def _with_header(path: Path, header: object | bytes, body: bytes = b"") -> Path:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + body)
    return path


_W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


# Each case crashed the reader before it checked headers whole (found by the fuzzer of
# test_fuzz_serialization.py): TypeError/IndexError/KeyError sorting on bad data_offsets, TypeError on a
# dtype that is not hashable, NumPy errors on shapes it cannot address, RecursionError and ValueError in
# the JSON parser.
@pytest.mark.parametrize(("header", "message"), [
    ({"w": {**_W, "data_offsets": "08"}}, r"tensor 'w' has data_offsets '08'; expected \[begin, end\]"),
    ({"w": {**_W, "data_offsets": 8}}, r"tensor 'w' has data_offsets 8; expected \[begin, end\]"),
    ({"w": {**_W, "data_offsets": []}}, r"tensor 'w' has data_offsets \[\]"),
    ({"w": {**_W, "data_offsets": {"0": 0}}}, r"tensor 'w' has data_offsets \{'0': 0\}"),
    ({"w": {**_W, "data_offsets": ["0", 8]}, "v": _W}, r"tensor 'w' has data_offsets \['0', 8\]"),
    ({"w": {**_W, "data_offsets": [0, 8.0]}}, r"tensor 'w' has data_offsets \[0, 8.0\]"),
    ({"w": {**_W, "data_offsets": [8, 0]}}, r"tensor 'w' has data_offsets \[8, 0\]; expected \[begin, end\] "
                                              r"with 0 <= begin <= end"),
    ({"w": {**_W, "dtype": ["F32"]}}, r"tensor 'w' has dtype \['F32'\]; expected one of BOOL, U8"),
    ({"w": {**_W, "dtype": {"F32": 1}}}, r"tensor 'w' has dtype \{'F32': 1\}"),
    ({"w": {**_W, "shape": [True, 2]}}, r"tensor 'w' has shape \[True, 2\]; expected a list of at most 32 ints"),
    ({"w": {**_W, "shape": [1] * 65}}, r"tensor 'w' has shape \[1, 1, 1, .*; expected a list of at most 32 ints >= 0"),
    ({"w": {**_W, "shape": [0, 2**62, 2**62]}},
     r"tensor 'w' has shape \[0, 4611686018427387904, 4611686018427387904\], whose dimensions exceed what an"),
    ({"w": {**_W, "shape": [2**40, 2**40]}},
     r"tensor 'w' has shape \[1099511627776, 1099511627776\], whose dimensions exceed what an array"),
    ({"w": {**_W, "shape": [2**64]}},
     r"tensor 'w' has shape \[18446744073709551616\], whose dimensions exceed what an array"),
    ({"w": {"dtype": "F32", "shape": [2]}}, r"tensor 'w': expected an object with dtype, shape and data_offsets"),
    ({"w": 5}, r"tensor 'w': expected an object with dtype, shape and data_offsets, got int"),
    (b"[" * 100_000 + b"]" * 100_000, r"header is not valid JSON: nested too deeply to parse"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, r"header is not valid JSON: nested too deeply to parse"),
    (b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}',
     r"header is not valid JSON: Exceeds the limit \(4300 digits\)"),
    (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "w": {}}',
     r"header is not valid JSON: duplicate key 'w'"),
    (b"\xff\xfe{}", r"header is not valid JSON: 'utf-8' codec can't decode"),
    ([], r"header must be a JSON object, got list"),
    ({"__metadata__": {"k": 1}}, r"__metadata__ must be an object of strings, got \{'k': 1\}"),
    ({"__metadata__": "k"}, r"__metadata__ must be an object of strings, got 'k'"),
])
def test_a_malformed_header_is_a_serialization_error_naming_the_file(tmp_path: Path, header: object,
                                                                      message: str) -> None:
    path = _with_header(tmp_path / "bad.safetensors", header, bytes(8))
    with pytest.raises(SerializationError, match=r"bad\.safetensors: " + message):
        load_file(path)


@pytest.mark.parametrize(("entries", "message"), [
    ({"a": {**_W, "data_offsets": [4, 12]}}, r"tensor 'a' starts at byte 4 of the data section, expected 0 "
                                            r"\(leaves a gap before it\)"),
    ({"a": _W, "b": {**_W, "data_offsets": [4, 12]}}, r"tensor 'b' starts at byte 4 .* expected 8 \(overlaps"),
    ({"a": {**_W, "shape": [1], "data_offsets": [0, 4]}}, r"4 bytes follow the last tensor in the data section"),
    ({"a": {**_W, "shape": [3], "data_offsets": [0, 12]}}, r"tensor 'a' occupies bytes \[0, 12\) but the data "
                                                          r"section holds 8 bytes \(truncated"),
    ({"a": {**_W, "shape": [3]}}, r"tensor 'a' of shape \[3\] and dtype F32 needs 12 bytes, its data_offsets "
                                  r"\[0, 8\] give 8"),
])
def test_entries_must_tile_the_data_section_exactly(tmp_path: Path, entries: dict[str, object], message: str) -> None:
    path = _with_header(tmp_path / "t.safetensors", entries, bytes(8))
    with pytest.raises(SerializationError, match=r"t\.safetensors: " + message):
        load_file(path)


def test_a_bool_tensor_holding_other_bytes_is_refused(tmp_path: Path) -> None:
    path = _with_header(tmp_path / "b.safetensors", {"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}},
                        b"\x01\x02")
    with pytest.raises(SerializationError, match=r"b\.safetensors: tensor 'm' of dtype BOOL holds bytes other than"):
        load_file(path)


def test_a_misaligned_tensor_loads_as_an_aligned_copy(tmp_path: Path) -> None:
    save_file({"a": bt.ones(3, dtype="uint8"), "b": bt.arange(4, dtype="float32")}, tmp_path / "m.safetensors")
    f = bt.read_safetensors(tmp_path / "m.safetensors")
    assert f.entries["b"] == bt.SafetensorsEntry(bt.float32, (4,), 3, 19)
    b = f.array("b")
    assert b.flags.aligned and b.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_missing_files_and_directories_are_serialization_errors(tmp_path: Path) -> None:
    with pytest.raises(SerializationError, match=r"nope\.safetensors: no such file"):
        load_file(tmp_path / "nope.safetensors")
    with pytest.raises(SerializationError, match=r"is a directory, not a safetensors file"):
        load_file(tmp_path)


def test_metadata_json_parses_with_the_header_limits(tmp_path: Path) -> None:
    bt.write_safetensors(tmp_path / "m.safetensors", {}, {"ok": '{"a": [1, 2]}', "deep": "[" * 100_000})
    f = bt.read_safetensors(tmp_path / "m.safetensors")
    assert f.metadata_json("ok") == {"a": [1, 2]}
    with pytest.raises(SerializationError, match=r"m\.safetensors: metadata 'deep' is not valid JSON: nested too"):
        f.metadata_json("deep")
    with pytest.raises(SerializationError, match=r"m\.safetensors: metadata has no 'gone' entry; present: \['deep'"):
        f.metadata_json("gone")


def test_write_safetensors_reports_progress_after_the_header_and_each_tensor(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    arrays = {"a": np.zeros(3, np.float32), "b": np.ones((2, 2), np.int64)}
    bt.write_safetensors(tmp_path / "p.safetensors", arrays, progress=lambda f, done, total: seen.append((done, total)))
    assert seen == [(0, 44), (12, 44), (44, 44)]
    back = bt.read_safetensors(tmp_path / "p.safetensors")
    np.testing.assert_array_equal(back.array("b"), arrays["b"])


def test_a_write_that_fails_on_disk_is_a_serialization_error_and_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors" / "occupied").mkdir(parents=True)  # the rename onto a non-empty directory fails
    with pytest.raises(SerializationError, match=r"x\.safetensors: writing failed: "):
        bt.write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(2, np.float32)})
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_write_safetensors_refuses_what_the_format_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(SerializationError, match=r"c\.safetensors: tensor 'c' has dtype complex64, which safetensors"):
        bt.write_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(SerializationError, match=r"tensor name '__metadata__' is not allowed"):
        bt.write_safetensors(tmp_path / "c.safetensors", {"__metadata__": np.zeros(2, np.float32)})
    with pytest.raises(SerializationError, match=r"metadata must map str to str; bad keys: \['n'\]"):
        bt.write_safetensors(tmp_path / "c.safetensors", {}, {"n": 1})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []
