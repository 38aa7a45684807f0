"""``load_file`` under the mutation fuzzer of tools/fuzz_safetensors.py, at CI size: every mutated file
loads or raises ``SerializationError`` naming the file; nothing else escapes (no KeyError, TypeError,
IndexError, RecursionError, NumPy error, ...). The mutators are described in the tool."""

from __future__ import annotations

from pathlib import Path

import pytest

from blutrain.tensor import load_file

# tools/ is on sys.path through the workspace's pytest config, and not there when the package is installed alone
tool = pytest.importorskip("fuzz_safetensors", reason="tools/ is not part of this checkout")


def test_load_file_loads_or_raises_serialization_error_naming_the_file(tmp_path: Path) -> None:
    result = tool.fuzz(4000, seed=20240521, crashes_dir=tmp_path)
    assert result.crashes == {}, result.crashes
    assert result.inputs == 4000
    assert result.loaded > 100 and result.rejected > 1000  # both outcomes were reached, often


def test_every_seed_of_the_fuzzer_loads(tmp_path: Path) -> None:
    for i, (data, (tensors, _)) in enumerate(zip(tool.seed_corpus(), tool.seed_cases(), strict=True)):
        path = tmp_path / f"seed{i}.safetensors"
        path.write_bytes(data)
        assert set(load_file(path)) == set(tensors)
