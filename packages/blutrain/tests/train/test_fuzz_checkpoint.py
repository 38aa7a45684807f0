"""The checkpoint reader under the fuzzer of tools/fuzz_checkpoint.py, at CI size: every mutated file
loads or raises CheckpointError naming the file; nothing else escapes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[4] / "tools" / "fuzz_checkpoint.py"


def _tool() -> ModuleType:
    if not TOOL.is_file():
        pytest.skip(f"{TOOL} is not part of this checkout (the package was installed on its own)")
    spec = importlib.util.spec_from_file_location("fuzz_checkpoint", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_checkpoint_reader_survives_the_fuzzer(tmp_path: Path) -> None:
    tool = _tool()
    result = tool.fuzz(3000, seed=20240520, crashes_dir=tmp_path)
    assert result.crashes == {}, result.crashes
    assert result.inputs == 3000
    assert result.loaded > 0 and result.rejected > 0  # both outcomes were reached


def test_every_seed_of_the_fuzzer_is_a_valid_checkpoint(tmp_path: Path) -> None:
    from blutrain.train import load_checkpoint

    for i, data in enumerate(_tool().seed_corpus()):
        path = tmp_path / f"seed{i}.safetensors"
        path.write_bytes(data)
        assert load_checkpoint(path)["trainer"]["step"] == i
