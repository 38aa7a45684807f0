"""Token shards: the llm.c / modded-nanogpt file format and its validation."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from blutrain.data import SHARD_MAGIC, SHARD_VERSION, ShardError, read_shard, write_shard


def _raw_shard(path: Path, magic: int, version: int, count: int, n_tokens: int) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, count
    path.write_bytes(header.tobytes() + np.arange(n_tokens, dtype="<u2").tobytes())
    return path


@settings(max_examples=60, deadline=None)
@given(tokens=arrays(np.uint16, st.one_of(st.just(0), st.just(1), st.integers(0, 3000))))
def test_write_then_read_returns_the_same_tokens(tokens: np.ndarray) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = write_shard(Path(d) / "s.bin", tokens)
        read = read_shard(path)
        assert read.dtype == np.dtype("<u2")
        assert read.shape == tokens.shape
        np.testing.assert_array_equal(read, tokens)
        del read  # release the mapping before the directory goes


def test_write_shard_accepts_any_integer_dtype_in_range(tmp_path: Path) -> None:
    tokens = np.array([0, 1, 50256, 65535], dtype=np.int64)
    np.testing.assert_array_equal(read_shard(write_shard(tmp_path / "s.bin", tokens)), tokens)


def test_shard_file_is_llmc_header_then_little_endian_uint16(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "s.bin", [7, 258, 65535])
    raw = path.read_bytes()
    assert len(raw) == 1024 + 3 * 2
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, 3]
    assert not header[3:].any()
    assert raw[1024:] == bytes([7, 0, 2, 1, 255, 255])


def test_read_shard_maps_the_file_instead_of_copying(tmp_path: Path) -> None:
    tokens = read_shard(write_shard(tmp_path / "s.bin", np.arange(10)))
    assert isinstance(tokens, np.memmap)
    assert tokens.offset == 1024
    assert not tokens.flags.writeable


def test_write_shard_rejects_id_above_uint16(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"s\.bin.*\[0, 65535\].*received 65536 at position 2"):
        write_shard(tmp_path / "s.bin", np.array([1, 2, 65536, 3]))
    assert not (tmp_path / "s.bin").exists()


def test_write_shard_rejects_negative_id(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"received -1 at position 0"):
        write_shard(tmp_path / "s.bin", np.array([-1, 2]))


def test_write_shard_rejects_float_tokens(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"integers, received dtype float32"):
        write_shard(tmp_path / "s.bin", np.ones(3, dtype=np.float32))


def test_write_shard_rejects_2d_tokens(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"1-D, received shape \(2, 2\)"):
        write_shard(tmp_path / "s.bin", np.ones((2, 2), dtype=np.int32))


def test_write_shard_leaves_only_the_shard_in_the_directory(tmp_path: Path) -> None:
    write_shard(tmp_path / "s.bin", np.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]


def test_read_shard_rejects_wrong_magic_naming_file_and_both_values(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "bad.bin", 12345, SHARD_VERSION, 4, 4)
    with pytest.raises(ShardError, match=rf"bad\.bin.*magic.*expected {SHARD_MAGIC}, received 12345"):
        read_shard(path)


def test_read_shard_rejects_wrong_version_naming_file_and_both_values(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "bad.bin", SHARD_MAGIC, 7, 4, 4)
    with pytest.raises(ShardError, match=r"bad\.bin.*version, expected 1, received 7"):
        read_shard(path)


def test_read_shard_rejects_truncated_file(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "bad.bin", SHARD_MAGIC, SHARD_VERSION, 10, 9)
    with pytest.raises(
        ShardError, match=r"bad\.bin: truncated: header declares 10 tokens.*1044 bytes; received 1042"
    ):
        read_shard(path)


def test_read_shard_rejects_oversized_file(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "bad.bin", SHARD_MAGIC, SHARD_VERSION, 2, 5)
    with pytest.raises(
        ShardError, match=r"bad\.bin: oversized: header declares 2 tokens.*1028 bytes; received 1034"
    ):
        read_shard(path)


def test_read_shard_rejects_file_shorter_than_header(tmp_path: Path) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ShardError, match=r"bad\.bin: file is 100 bytes, shorter than the 1024-byte header"):
        read_shard(path)


def test_read_shard_rejects_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"nothere\.bin: no such file"):
        read_shard(tmp_path / "nothere.bin")


def test_shard_error_is_a_value_error() -> None:
    assert issubclass(ShardError, ValueError)


def test_read_shard_on_a_directory_is_a_shard_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "d.bin").mkdir()
    with pytest.raises(ShardError, match=r"d\.bin: cannot be read"):
        read_shard(tmp_path / "d.bin")


def test_read_shard_rejects_negative_token_count(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "n.bin", SHARD_MAGIC, SHARD_VERSION, -4, 0)
    with pytest.raises(ShardError, match=r"n\.bin: header declares a negative token count \(-4\)"):
        read_shard(path)


def test_a_shard_of_zero_tokens_is_valid_and_empty(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "z.bin", SHARD_MAGIC, SHARD_VERSION, 0, 0)
    assert read_shard(path).shape == (0,)
