"""The "nccl" backend: it registers and imports without a GPU; on GPUs (marker ``cuda``) every
collective matches a NumPy reference across ``blutrain run`` ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blutrain.dist import DistError, comm_backends
from blutrain_backend_cupy import cuda
from blutrain_comm_nccl import create_group

WORKER = Path(__file__).parent / "nccl_worker.py"


def test_the_plugin_registers_nccl_without_needing_a_gpu() -> None:
    assert comm_backends().get("nccl") is create_group


def test_a_group_without_a_store_is_an_error_saying_how_to_get_one() -> None:
    with pytest.raises(DistError, match="blutrain run -n N"):
        create_group(rank=0, world_size=2, store=None, timeout=10.0)


def _gpus() -> int:
    return cuda.device_count() if cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.parametrize("ranks", [1, 2])
def test_collectives_match_numpy_on_gpus(tmp_path: Path, ranks: int) -> None:
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} NVIDIA GPU(s) and CuPy")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "run", "-n", str(ranks), "--timeout", "60", "--",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for r in range(ranks):
        results = json.loads(Path(f"{out}.{r}.json").read_text())
        bad = {k: v for k, v in results.items() if not v["ok"]}
        assert not bad, f"rank {r}: {bad}"
        assert len(results) == 9
