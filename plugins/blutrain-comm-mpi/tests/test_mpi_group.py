"""The "mpi" backend in one process (an MPI singleton): registration, argument checks, and the timeout
that turns a receive nobody sends into an error. Multi-rank behaviour: integration_tests/test_dist_mpi.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError, comm_backends
from blutrain_comm_mpi import create_group


def test_the_plugin_registers_mpi() -> None:
    assert comm_backends().get("mpi") is create_group


def test_a_group_of_one_reduces_to_itself_and_checks_its_arguments() -> None:
    group = create_group(rank=0, world_size=1, store=None, timeout=30.0)
    t = bt.tensor(np.arange(6, dtype=np.float32))
    group.all_reduce(t, op="avg")
    assert np.array_equal(t.numpy(), np.arange(6, dtype=np.float32))
    with pytest.raises(DistArgumentError, match="op must be one of sum, avg, max, min, got 'mean'"):
        group.all_reduce(t, op="mean")  # type: ignore[arg-type]
    with pytest.raises(DistArgumentError, match="output must have shape \\[6\\]"):
        group.all_gather_into_tensor(bt.empty(5), t)
    with pytest.raises(DistArgumentError, match=r"src must be a rank in 0\.\.0, got 1"):
        group.broadcast(t, src=1)
    with pytest.raises(DistArgumentError, match="op 'avg' needs a floating tensor"):
        group.all_reduce(bt.tensor([1, 2]), op="avg")
    group.destroy()


def test_a_receive_nobody_sends_times_out_with_a_clear_error() -> None:
    # in a child process: after a timeout the process must not finalize MPI, and it exits at once
    code = textwrap.dedent("""
        import blutrain.tensor as bt
        from blutrain.dist import CollectiveTimeoutError
        from blutrain_comm_mpi import create_group
        group = create_group(rank=0, world_size=1, store=None, timeout=0.5)
        try:
            group.recv(bt.empty(3), src=0)
        except CollectiveTimeoutError as exc:
            print("raised:", exc)
        try:
            group.barrier()
        except Exception as exc:
            print("then:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "raised: recv from rank 0 timed out on rank 0 of 1 (group world) after 0.5 s" in proc.stdout
    assert "then: barrier: the mpi group world is unusable after an earlier failure" in proc.stdout
