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
from blutrain_comm_nccl.group import communicator, reserve_requested_by_env, unique_id_bytes

WORKER = Path(__file__).parent / "nccl_worker.py"


def test_the_plugin_registers_nccl_without_needing_a_gpu() -> None:
    assert comm_backends().get("nccl") is create_group


def test_a_group_without_a_store_is_an_error_saying_how_to_get_one() -> None:
    with pytest.raises(DistError, match="blutrain run -n N"):
        create_group(rank=0, world_size=2, store=None, timeout=10.0)


def test_the_sm_reservation_beside_collectives_is_off_unless_asked_and_refuses_a_malformed_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLUTRAIN_NCCL_RESERVE_SMS", raising=False)
    assert reserve_requested_by_env() is None
    monkeypatch.setenv("BLUTRAIN_NCCL_RESERVE_SMS", "24:3")
    assert reserve_requested_by_env() == (24, 3)
    for bad in ("24", "24:", ":3", "a:3", "24:-1", "24:3:1"):
        monkeypatch.setenv("BLUTRAIN_NCCL_RESERVE_SMS", bad)
        with pytest.raises(DistError, match=f"BLUTRAIN_NCCL_RESERVE_SMS must be SMS:PRODUCTS .* got '{bad}'"):
            reserve_requested_by_env()


class _TupleIdNccl:
    """The part of cupy.cuda.nccl whose unique id is a tuple of signed chars (CuPy before 14)."""

    @staticmethod
    def NcclCommunicator(size: int, comm_id: object, rank: int) -> tuple[int, object, int]:
        if not isinstance(comm_id, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(comm_id).__name__})")
        return size, comm_id, rank


class _BytesIdNccl:
    """The part of cupy.cuda.nccl whose unique id is bytes (CuPy 14)."""

    @staticmethod
    def NcclCommunicator(size: int, comm_id: object, rank: int) -> tuple[int, object, int]:
        if not isinstance(comm_id, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
        return size, comm_id, rank


def test_the_unique_id_reaches_other_ranks_in_the_form_their_cupy_takes() -> None:
    signed = tuple(range(-128, 0)) + tuple(range(128))  # 256 C chars, every value once
    raw = unique_id_bytes(signed)
    assert raw == bytes(range(128, 256)) + bytes(range(128))
    assert communicator(_TupleIdNccl, 2, raw, 1) == (2, signed, 1)
    assert unique_id_bytes(raw) == raw
    assert communicator(_BytesIdNccl, 2, raw, 1) == (2, raw, 1)


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
        assert len(results) == 13
