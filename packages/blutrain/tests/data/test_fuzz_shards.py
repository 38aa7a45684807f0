"""tools/fuzz_shards.py at CI size: mutated shards make the reader and loader raise only their documented
errors, and accept exactly what the format allows. The full run (1,000,000 inputs) is the tool itself."""

from __future__ import annotations

import importlib
import struct
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from blutrain.data import write_shard


@pytest.fixture(scope="module")
def fuzzer() -> ModuleType:
    return importlib.import_module("fuzz_shards")  # tools/ is on sys.path through the workspace's pytest config


def test_a_ci_sized_run_finds_no_crash_or_mismatch_and_reaches_every_outcome(fuzzer: ModuleType) -> None:
    report = fuzzer.run_chunk(seed=20240520, chunk=0, count=3000)
    assert report.inputs == 3000
    assert report.crashes == []
    assert report.bugs == 0
    for outcome in ("accepted", "reader:ShardError", "loader:LoaderError"):
        assert report.outcomes[outcome] > 30, report.outcomes


def test_the_same_seed_and_chunk_fuzz_the_same_inputs(fuzzer: ModuleType) -> None:
    assert fuzzer.run_chunk(3, 1, 300).outcomes == fuzzer.run_chunk(3, 1, 300).outcomes


def _naive_reader(path: Path) -> np.ndarray:
    """A reader that trusts the header: what the fuzzer exists to catch."""
    data = path.read_bytes()
    count = struct.unpack_from("<i", data, 8)[0]
    return np.frombuffer(data, dtype="<u2", count=count, offset=1024)


def test_a_reader_that_trusts_its_input_is_reported_with_the_input_saved(fuzzer: ModuleType, tmp_path: Path) -> None:
    report = fuzzer.run_chunk(0, 0, 300, str(tmp_path), reader=_naive_reader)
    assert report.outcomes["crash"] > 0 and report.outcomes["mismatch"] > 0
    first = report.crashes[0]
    assert first["kind"] in ("crash", "mismatch") and first["traceback"]
    saved = sorted(tmp_path.glob("*.bin"))
    assert len(saved) == report.bugs
    assert {p.with_suffix(".txt").exists() for p in saved} == {True}


def test_the_oracle_accepts_what_write_shard_writes_and_nothing_else(fuzzer: ModuleType, tmp_path: Path) -> None:
    tokens = [0, 7, 65535, 256]
    data = write_shard(tmp_path / "s.bin", tokens).read_bytes()
    assert fuzzer.parse(data) == tokens
    assert fuzzer.parse(data[:-1]) is None
    assert fuzzer.parse(data + b"\0\0") is None
    assert fuzzer.parse(data[:1023]) is None
    assert fuzzer.parse(b"\1" + data[1:]) is None
