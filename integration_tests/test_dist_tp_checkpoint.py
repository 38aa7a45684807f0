"""Checkpoints under tensor parallelism on 2 and 4 MPI ranks: each rank of one tp group writes its shard and
the index, asynchronously too, and a checkpoint saved with one layout resumes in another.

One uninterrupted single-process run (8 rows per step, 4 steps, a checkpoint after step 2) is the
reference. Under `blutrain run -n 2` (dist_workers/train_runs.py, the runs in one launch): tp = 2 from
scratch with asynchronous checkpoints after every step (--keep 2), then three runs resumed at step 2 —
tp = 2 from tp's checkpoint, ddp from tp's checkpoint, tp = 2 from the single process's checkpoint.
One process resumes from tp's checkpoint; `blutrain train --parallel dp=2,tp=2,async=2` on 4 ranks resumes
from it too and saves step 3 asynchronously, which one process resumes again. Every resumed run's losses
must continue those of the uninterrupted run within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ranks import assert_merged_like_one_process, launch, load_worker

WORKER = Path(__file__).parent / "dist_workers" / "train_runs.py"


def _worker() -> Any:
    return load_worker(WORKER)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tpckpt")
    worker = _worker()
    worker.train({"out": str(d / "one"), "batch_size": 8, "checkpoint_every": 2})
    tp_step2 = str(d / "tp" / "step_000002.safetensors")
    spec = [{"out": str(d / "tp"), "batch_size": 8, "parallel": "tp=2", "async_checkpoint": True,
             "checkpoint_every": 1, "keep": 2},
            {"out": str(d / "tp-from-tp"), "batch_size": 8, "parallel": "tp=2", "resume": tp_step2},
            {"out": str(d / "ddp-from-tp"), "batch_size": 4, "parallel": "ddp", "resume": tp_step2},
            {"out": str(d / "tp-from-one"), "batch_size": 8, "parallel": "tp=2",
             "resume": str(d / "one" / "step_000002.safetensors")}]
    (d / "spec.json").write_text(json.dumps(spec))
    launch(2, WORKER, d / "spec.json")
    worker.train({"out": str(d / "one-from-tp"), "batch_size": 8, "resume": tp_step2})
    config = d / "c.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in worker.BASE.items() if k != "model_overrides")
                      + "model_overrides = { n_layer = 2, n_head = 2, n_embd = 32 }\n")
    launch(4, "blutrain", "train", "--config", config, "--batch-size", "4", "--parallel", "dp=2,tp=2,async=2",
            "--resume", tp_step2, "--async-checkpoint", "--checkpoint-every", "1", "--out", d / "dptp-from-tp")
    worker.train({"out": str(d / "one-from-dptp"), "batch_size": 8,
                  "resume": str(d / "dptp-from-tp" / "step_000003.safetensors")})
    return d


def losses(directory: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (directory / "metrics.jsonl").read_text().splitlines()]


def test_tp_with_asynchronous_checkpoints_trains_as_one_process(runs: Path) -> None:
    one = losses(runs / "one")
    assert len(one) == 4
    np.testing.assert_allclose(losses(runs / "tp"), one, rtol=1e-5, atol=0)


def test_each_tp_rank_writes_its_shard_and_old_ones_go_only_with_every_ranks_file(runs: Path) -> None:
    # steps 1-3 saved asynchronously with --keep 2: step 1 is deleted, its rank-1 file with it
    assert sorted(p.name for p in (runs / "tp").glob("*.safetensors")) == [
        "final.rank1-of-2.safetensors", "final.safetensors", "step_000002.rank1-of-2.safetensors",
        "step_000002.safetensors", "step_000003.rank1-of-2.safetensors", "step_000003.safetensors"]
    # dp × tp: one tp group writes (2 files, not 4), the step saved asynchronously
    assert sorted(p.name for p in (runs / "dptp-from-tp").glob("*.safetensors")) == [
        "final.rank1-of-2.safetensors", "final.safetensors", "step_000003.rank1-of-2.safetensors",
        "step_000003.safetensors"]


@pytest.mark.parametrize(("resumed", "uninterrupted", "first"), [
    ("tp-from-tp", "tp", 2), ("one-from-tp", "one", 2), ("ddp-from-tp", "one", 2), ("tp-from-one", "one", 2),
    ("dptp-from-tp", "one", 2), ("one-from-dptp", "one", 3)])
def test_a_resumed_run_continues_the_uninterrupted_losses(runs: Path, resumed: str, uninterrupted: str,
                                                          first: int) -> None:
    got = losses(runs / resumed)
    assert len(got) == 4 - first
    np.testing.assert_allclose(got, losses(runs / uninterrupted)[first:], rtol=1e-5, atol=0)


def test_a_tp_checkpoint_merges_into_the_single_process_state(runs: Path) -> None:
    from blutrain.train import load_checkpoint
    from blutrain.train.sharded import load_any_checkpoint

    assert_merged_like_one_process(load_any_checkpoint(runs / "tp" / "final.safetensors"),
                                   load_checkpoint(runs / "one" / "final.safetensors"), steps=4)
