"""Multi-rank runs on the CPU through the "mpi" backend and `blutrain run` (2 and 4 ranks).

Collectives against NumPy references, DDP training of a tiny GPT-2 against the single-process run,
and the launcher's failure handling: a killed rank, a rank that raises, and a rank that hangs in a
collective all make `blutrain run` exit non-zero within the timeout, name the rank, and leave no
process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

WORKERS = Path(__file__).parent / "dist_workers"
CHECKS = ["all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_reduce_min", "all_reduce_sum_float64",
          "all_reduce_sum_int64", "all_reduce_sum_bfloat16", "all_reduce_strided_view", "reduce_scatter_sum",
          "all_gather_into_tensor", "all_gather_list", "broadcast_bfloat16", "all_to_all", "send_recv_ring",
          "all_reduce_async_three_in_flight", "all_reduce_coalesced_avg", "barrier", "mesh_groups"]


def blutrain_run(n: int, *args: str | Path, timeout: float | None = None,
                 limit: float = 120.0) -> subprocess.CompletedProcess[str]:
    extra = ["--timeout", str(timeout)] if timeout is not None else []
    cmd = [sys.executable, "-m", "blutrain.cli", "run", "-n", str(n), "--grace", "2", *extra, "--",
           *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=limit)


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


# ------------------------------------------------------------------------------------ collectives


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def collective_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    n = request.param
    prefix = tmp_path_factory.mktemp(f"coll{n}") / "out"
    proc = blutrain_run(n, WORKERS / "collectives.py", prefix, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(Path(f"{prefix}.{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("check", CHECKS)
def test_collective_matches_numpy_reference_on_every_rank(collective_results: list[Any], check: str) -> None:
    for rank, results in enumerate(collective_results):
        assert results[check]["ok"], f"rank {rank}: {check}: {results[check]}"


# ------------------------------------------------------------------------------------ ddp


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Any]:
    out = tmp_path_factory.mktemp("ddp1") / "ref"
    proc = subprocess.run([sys.executable, str(WORKERS / "ddp_gpt.py"), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(Path(f"{out}.json").read_text())["losses"], np.load(f"{out}.npz")


def test_ddp_with_bf16_gradient_averages_trains_as_the_float32_average_within_bf16(
        single_process: tuple[list[float], Any], tmp_path: Path) -> None:
    """``grad_dtype=bf16`` sends each bucket as one flat bf16 buffer and widens the average back into the float32
    gradients: the parameters stay float32, and three AdamW steps stay within bf16's rounding of the float32 run
    (a wrong or missing average is off by ~1e-3 in the weights, one rank's gradient alone by more)."""
    out = tmp_path / "ddp_bf16"
    proc = blutrain_run(2, WORKERS / "ddp_gpt.py", "--out", out, "--grad-dtype", "bf16", timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(Path(f"{out}.json").read_text())
    assert got["grad_dtypes"] == ["float32"]
    ref_losses, ref_params = single_process
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-4, atol=0)
    params = np.load(f"{out}.npz")
    # AdamW's normalized update moves every weight by about lr = 3e-3 a step, whatever the gradient's size, so a
    # bf16 rounding that flips the sign of a tiny gradient component moves that weight by up to 2 lr; the rest
    # follow the float32 run closely
    worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params.files)
    typical = np.median([float(np.abs(params[n] - ref_params[n]).mean()) for n in ref_params.files])
    assert worst <= 6 * 3e-3 and typical < 1e-4, (worst, typical)  # measured: 3.0e-3 and 1.4e-5


@pytest.mark.parametrize(("ranks", "accum"), [(2, 1), (4, 1), (2, 2)], ids=["2ranks", "4ranks", "2ranks-no_sync"])
def test_ddp_tiny_gpt_matches_single_process(single_process: tuple[list[float], Any], tmp_path: Path, ranks: int,
                                             accum: int) -> None:
    out = tmp_path / "ddp"
    proc = blutrain_run(ranks, WORKERS / "ddp_gpt.py", "--out", out, "--accum", str(accum), timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(Path(f"{out}.json").read_text())
    assert got["world"] == ranks and got["buckets"] > 1
    ref_losses, ref_params = single_process
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5, atol=0)
    params = np.load(f"{out}.npz")
    assert sorted(params.files) == sorted(ref_params.files)
    for name in ref_params.files:
        # AdamW normalizes each update, which turns float32 reduction-order noise in tiny gradients into
        # differences of a few 1e-6 after three steps; a wrong or missing average is off by ~1e-3
        np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=3e-5, err_msg=name)


# ------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize(("mode", "rank_named", "error"), [
    ("kill", "rank 1", "killed by SIGKILL"),
    ("raise", "rank 1", "ValueError: rank 1 is broken"),
    ("hang", "rank 0", "CollectiveTimeoutError: all_reduce timed out on rank 0"),
])
def test_a_failing_rank_stops_the_job_names_the_rank_and_leaves_no_process(tmp_path: Path, mode: str,
                                                                          rank_named: str, error: str) -> None:
    pidfile = tmp_path / "pids"
    start = time.monotonic()
    proc = blutrain_run(3, WORKERS / "faulty.py", mode, pidfile, timeout=4, limit=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    report = [line for line in proc.stderr.splitlines() if line.startswith("blutrain run:")]
    assert report and report[0].startswith(f"blutrain run: {rank_named} ") and error in report[0], proc.stderr
    if mode == "hang":
        assert any("rank(s) 1 had not failed" in line and "hung" in line for line in report), proc.stderr
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 6  # every rank and the child each one started
    assert alive(pids) == [], f"left behind: {alive(pids)}"
    assert elapsed < 45  # bounded by the collective timeout (4 s) and the grace period, not a hang


def test_sigterm_to_blutrain_run_is_forwarded_to_every_rank(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    cmd = [sys.executable, "-m", "blutrain.cli", "run", "-n", "2", "--grace", "2", "--", str(WORKERS / "faulty.py"),
           "wait", str(pidfile)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not pidfile.exists() or len(pidfile.read_text().split()) < 4):
        time.sleep(0.1)
    proc.send_signal(15)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + 15
    assert "received SIGTERM" in err
    pids = [int(p) for p in pidfile.read_text().split()]
    assert alive(pids) == []


def test_blutrain_run_without_a_command_is_an_error_naming_the_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "run", "-n", "2"], capture_output=True, text=True,
                          env={**os.environ}, timeout=60)
    assert proc.returncode != 0 and "no command given" in proc.stderr
