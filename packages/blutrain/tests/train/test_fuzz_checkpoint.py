"""The checkpoint reader under the fuzzer of tools/fuzz_checkpoint.py, at CI size: every mutated file
loads or raises CheckpointError naming the file; nothing else escapes."""

from __future__ import annotations

from pathlib import Path

import pytest

# tools/ is on sys.path through the workspace's pytest config, and not there when the package is installed alone
tool = pytest.importorskip("fuzz_checkpoint", reason="tools/ is not part of this checkout")


def test_checkpoint_reader_survives_the_fuzzer(tmp_path: Path) -> None:
    result = tool.fuzz(3000, seed=20240520, crashes_dir=tmp_path)
    assert result.crashes == {}, result.crashes
    assert result.inputs == 3000
    assert result.loaded > 0 and result.rejected > 0  # both outcomes were reached


def test_every_seed_of_the_fuzzer_is_a_valid_checkpoint(tmp_path: Path) -> None:
    from blutrain.train import load_checkpoint

    for i, data in enumerate(tool.seed_corpus()):
        path = tmp_path / f"seed{i}.safetensors"
        path.write_bytes(data)
        assert load_checkpoint(path)["trainer"]["step"] == i
