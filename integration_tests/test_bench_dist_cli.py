"""tools/bench/dist_cli.py, several GPUs through the command line: its scoring of rows (efficiency for a
data-parallel mode, speed-up and the largest loss difference for a mode that trains on one GPU's batch), its
``--extra`` rows, and the whole tool on CPU MPI ranks with the tiny preset (the plumbing; no time is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

cli = pytest.importorskip("bench.dist_cli", reason="tools/ is not part of this checkout")
TOOL = Path(cli.__file__)


def test_data_parallel_rows_get_an_efficiency_and_same_batch_rows_a_speedup_and_a_loss_difference() -> None:
    rows = [{"gpus": 1, "mode": "single", "compiled": True, "tok_per_s": 100.0, "losses": [5.0, 4.0, 3.0]},
            {"gpus": 1, "mode": "single", "compiled": False, "tok_per_s": 50.0, "losses": [5.0, 4.5]},
            {"gpus": 2, "mode": "ddp", "compiled": True, "tok_per_s": 190.0, "losses": [5.0, 3.0, 1.0]},
            {"gpus": 4, "mode": "dp=2,tp=2", "compiled": True, "tok_per_s": 190.0, "losses": [5.0]},
            {"gpus": 4, "mode": "tp=4", "compiled": True, "tok_per_s": 250.0, "losses": [5.0, 4.25, 2.5]},
            {"gpus": 2, "mode": "tp=2", "compiled": False, "tok_per_s": 40.0, "losses": [5.5, 4.5, 4.0]},
            {"gpus": 2, "mode": "cp=2", "compiled": True, "error": "out of memory"}]
    cli.scaling(rows)
    assert rows[2]["efficiency"] == pytest.approx(0.95) and "speedup" not in rows[2]
    assert rows[3]["efficiency"] == pytest.approx(0.475)  # a mesh with dp splits the batch too
    assert rows[4]["speedup"] == pytest.approx(2.5) and rows[4]["max_dloss"] == pytest.approx(0.5)
    # against the eager one-GPU row, over the two steps both ran
    assert rows[5]["speedup"] == pytest.approx(0.8) and rows[5]["max_dloss"] == pytest.approx(0.5)
    assert "speedup" not in rows[6] and "efficiency" not in rows[6]


def test_an_extra_row_that_is_not_mode_at_n_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--extra", "tp=2@two"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--extra: each row must be MODE@N or MODE@N:eager, got 'tp=2@two'" in proc.stderr


def test_on_cpu_ranks_it_trains_one_process_and_tp_and_scores_them(tmp_path: Path) -> None:
    """One process and tp=2 on 2 MPI ranks, compiled, with a config line: both rows train, and tp=2's losses
    follow the one process's (the same batch, seed and weights; float32)."""
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--preset", "tiny", "--dtype", "fp32",
                           "--gpus", "2", "--out", str(out), "--steps", "3", "--tail", "2", "--batch-size", "2",
                           "--seq-len", "32", "--modes", "", "--extra", "tp=2@2",
                           "--config", "model_overrides = { n_layer = 1, n_head = 2, n_embd = 32 }"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "dist_cli.json").read_text())
    assert [(r["gpus"], r["mode"], r["compiled"]) for r in rows] == [(1, "single", True), (2, "tp=2", True)]
    assert all(r["steps"] == 3 for r in rows)
    assert rows[1]["max_dloss"] < 1e-4 and rows[1]["speedup"] > 0
    assert "tp=2" in proc.stdout and "max|dl|" in proc.stdout
