"""Rank and world from blutrain run, torchrun, mpirun (Open MPI and PMI) and Slurm variables."""

from __future__ import annotations

import pytest

from blutrain.dist import DistEnvironmentError, detect


def test_nothing_set_is_a_single_process() -> None:
    env = detect({})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "single process")


def test_torchrun_variables() -> None:
    env = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.1", 29500, "torchrun")


def test_blutrain_run_is_recognized_by_its_store() -> None:
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "BLUTRAIN_STORE": "127.0.0.1:4000"})
    assert env.source == "blutrain run" and env.store_addr == "127.0.0.1:4000"


def test_open_mpi_variables() -> None:
    env = detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (2, 4, 0, "openmpi")


def test_mpich_hydra_pmi_variables() -> None:
    env = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source) == (1, 2, 1, 2, "pmi")


def test_slurm_variables() -> None:
    env = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source) == (5, 8, 1, 4, "slurm")


def test_the_timeout_comes_from_its_variable() -> None:
    assert detect({"BLUTRAIN_DIST_TIMEOUT": "2.5"}).timeout == 2.5
    with pytest.raises(DistEnvironmentError, match="BLUTRAIN_DIST_TIMEOUT"):
        detect({"BLUTRAIN_DIST_TIMEOUT": "soon"})


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "0 <= rank < world size"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK must be an integer, got 'x'"),
    ({"MASTER_ADDR": "h"}, "MASTER_ADDR and MASTER_PORT must be set together"),
])
def test_inconsistent_variables_are_errors_naming_them(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistEnvironmentError, match=message):
        detect(env)
