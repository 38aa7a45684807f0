"""tools/bench/dist.py, the multi-GPU benchmark: its arithmetic and reporting on given rank results, and its CPU
mode end to end (MPI ranks through `blutrain run`, every stage's plumbing). No test here asserts a time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from blutrain.models import GPT2, GPT2Config

# tools/ is on sys.path through the workspace's pytest config, and not there when the package is installed alone
bench = pytest.importorskip("bench.dist", reason="tools/ is not part of this checkout")


def job(stage: str = "scaling", mode: str = "ddp", gpus: int = 2, **kw: Any) -> Any:
    fields: dict[str, Any] = {"framework": "blutrain", "device": "cuda", "preset": "gpt2-124m", "batch_size": 16,
                              "seq_len": 1024, "precision": "bf16", "steps": 3, "warmup": 1, "data": "random"}
    fields.update(kw)
    return bench.Job(stage, f"{stage}-{mode}-{gpus}", mode=mode, gpus=gpus, **fields)


def rank(r: int, **kw: Any) -> dict[str, Any]:
    return {"rank": r, "ok": True, "phase": "timed", "losses": [], "step_ms": [], "host_ms": [], **kw}


def test_scaling_efficiency_is_tokens_per_second_on_n_over_n_times_one() -> None:
    assert bench.scaling_efficiency(196_000.0, 100_000.0, 2) == pytest.approx(0.98)
    assert bench.scaling_efficiency(None, 100_000.0, 2) is None
    assert bench.scaling_efficiency(196_000.0, None, 2) is None


def test_the_nccl_summary_names_the_version_and_counts_each_transport() -> None:
    log = "\n".join([
        "[rank0]: host:1:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.9",
        "[rank0]: host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "[rank0]: host:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "[rank1]: host:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct",
        "step 3: loss 9.1",
    ])
    assert bench.nccl_summary(log) == "NCCL 2.27.3+cuda12.9: 2 × P2P/CUMEM/read, 1 × SHM/direct/direct"
    assert bench.nccl_summary("no nccl here\n") is None


def test_a_step_takes_as_long_as_its_slowest_rank() -> None:
    assert bench.slowest_rank_steps([[1.0, 5.0, 3.0], [2.0, 4.0, 3.0, 9.0]]) == [2.0, 5.0, 3.0]
    assert bench.slowest_rank_steps([]) == []


def test_the_parameter_count_is_the_models() -> None:
    cfg = GPT2Config.preset("tiny", n_layer=2, block_size=64)
    assert bench.param_count(cfg) == GPT2(cfg).num_parameters()


def test_the_default_cap_fits_zero3_shards_on_two_gpus_but_not_replicated_adamw_state() -> None:
    params = bench.param_count(GPT2Config.preset("gpt2-774m"))
    cap = bench.default_cap_bytes(params)
    assert 16 * params / 2 < cap < 16 * params  # fp32 weights, gradients, m and v: sharded over 2, or whole


def test_a_loss_falls_when_finite_and_the_last_is_below_the_first() -> None:
    assert bench.loss_falls([10.9, 9.0, 7.5])
    assert not bench.loss_falls([10.9, 11.0])
    assert not bench.loss_falls([10.9, math.nan, 7.5])
    assert not bench.loss_falls([10.9])


def test_a_row_is_timed_from_every_ranks_steps(tmp_path: Path) -> None:
    row = bench.Row(job())
    bench.collect(row, [rank(0, step_ms=[100.0, 110.0, 90.0], host_ms=[1.0] * 3, losses=[5.0, 4.0]),
                        rank(1, step_ms=[105.0, 100.0, 95.0], host_ms=[2.0] * 3, losses=[7.0, 6.0])],
                  0, tmp_path / "log")
    assert row.status == "ok" and row.as_expected
    assert row.step_ms == 105.0  # the median of 105, 110, 95
    assert row.tokens_per_s == pytest.approx(2 * 16 * 1024 / 0.105)
    assert row.losses == [6.0, 5.0]


def test_an_out_of_memory_rank_is_reported_before_a_peer_that_failed_after_it(tmp_path: Path) -> None:
    row = bench.Row(job("zero", cap_bytes=10 * 2**30, expect="oom"))
    bench.collect(row, [rank(0, ok=False, error="CollectiveTimeoutError: all_reduce timed out", phase="warm-up"),
                        rank(1, ok=False, error="OutOfMemoryError: out of memory", oom=True, phase="warm-up",
                             peak_allocated=9 * 2**30, cap_applied=True)],
                  3, tmp_path / "log")
    assert row.status == "oom" and row.as_expected
    assert row.error is not None and row.error.startswith("rank 1 in warm-up: OutOfMemoryError")
    assert row.peak_allocated == 9 * 2**30


def test_a_launch_stopped_at_its_limit_says_where_each_rank_was(tmp_path: Path) -> None:
    row = bench.Row(job("cp", "cp", attn="ring", timeout=150.0))
    bench.collect(row, [rank(0, ok=False, losses=[5.0, 4.9]), rank(1, ok=False, losses=[5.0, 4.9])], None,
                  tmp_path / "log")
    assert row.status == "timeout" and not row.as_expected
    assert row.error == "killed after 150 s; rank 0 in timed after 2 step(s); rank 1 in timed after 2 step(s)"


def test_the_table_names_each_failure_and_reports_the_goals() -> None:
    one, two = bench.Row(job(mode="single", gpus=1)), bench.Row(job())
    one.status, one.tokens_per_s = "ok", 100_000.0
    two.status, two.tokens_per_s, two.efficiency = "ok", 197_000.0, 0.985
    skipped = bench.Row(job(framework="torch", mode="single", gpus=1))
    skipped.status, skipped.error = "skipped", "PyTorch is not installed"
    text = bench.format_table([one, two, skipped], {"device": "cuda", "gpu": "H200", "gpus_found": 2})
    assert "skipped: PyTorch is not installed" in text
    assert "goal blutrain DDP scaling efficiency at 2 GPUs ≥ 98%: 98.5% — met" in text


def test_the_cpu_mode_runs_every_stage_through_blutrain_run(tmp_path: Path) -> None:
    script = Path(bench.__file__)
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--frameworks", "blutrain", "--steps", "2",
                           "--warmup", "1", "--batch-size", "2", "--seq-len", "32", "--zero-seq-len", "32",
                           "--zero-steps", "2", "--cp-seq-len", "64", "--cp-steps", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "bench_dist.json").read_text())["rows"]
    assert [r["job"]["name"] for r in rows] == ["scaling-blutrain-1gpu", "scaling-blutrain-2gpu", "zero-ddp",
                                                "zero-zero3", "cp-ring", "cp-allgather", "cp-ulysses"]
    assert all(r["status"] == "ok" and r["steps"] == 2 for r in rows)
    zero = [r["losses"] for r in rows if r["job"]["stage"] == "zero"]
    assert zero[0] == pytest.approx(zero[1], rel=1e-5)  # ZeRO-3 trains what DDP trains
    assert all(bench.loss_falls(r["losses"]) for r in rows if r["job"]["stage"] == "cp")
    assert (tmp_path / "bench_dist.txt").read_text().startswith("BluTrain distributed benchmark")
