"""ZeRO stages 1-3 on 2 and 4 MPI ranks against the single-process run, sharded state saved by one layout and
loaded by another, and `blutrain train --parallel` (ddp, zero=2) against a single-process `blutrain train` with
the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ranks import launch

from blutrain.train import load_checkpoint
from blutrain.train.sharded import load_any_checkpoint

WORKERS = Path(__file__).parent / "dist_workers"
WORKER = WORKERS / "zero_gpt.py"


def result(prefix: Path, stage: int) -> tuple[dict[str, Any], Any]:
    return json.loads(Path(f"{prefix}.{stage}.json").read_text()), np.load(f"{prefix}.{stage}.npz")


def assert_same_training(got: tuple[dict[str, Any], Any], ref: tuple[dict[str, Any], Any]) -> None:
    np.testing.assert_allclose(got[0]["losses"], ref[0]["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got[0]["norms"], ref[0]["norms"], rtol=1e-5, atol=0)
    assert sorted(got[1].files) == sorted(ref[1].files)
    for name in ref[1].files:
        # as the ddp test: AdamW turns float32 reduction-order noise into a few 1e-6; a wrong shard is ~1e-3 off
        np.testing.assert_allclose(got[1][name], ref[1][name], rtol=0, atol=3e-5, err_msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Single process (5 steps); 2 ranks, every stage (3 steps; stage 3 saves its shards); 4 ranks, every stage;
    2 ranks, stage 3 with activation checkpointing; then the 2-rank shards loaded by 4 ranks (stage 2) and by
    one process, for steps 4 and 5."""
    d = tmp_path_factory.mktemp("zero")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", d / "ref", "--stages", "0", "--steps", "5",
                           "--snapshot", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    launch(2, WORKER, "--out", d / "r2", "--stages", "1,2,3", "--save", d / "shards")
    launch(4, WORKER, "--out", d / "r4", "--stages", "1,2,3")
    launch(2, WORKER, "--out", d / "recompute2", "--stages", "3", "--checkpoint-activations")
    launch(4, WORKER, "--out", d / "load4", "--stages", "2", "--load", d / "shards", "--first", "3", "--steps", "2")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", d / "load1", "--stages", "0", "--load", d / "shards",
                           "--first", "3", "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return d


@pytest.mark.parametrize("ranks", [2, 4], ids=["2ranks", "4ranks"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_tiny_gpt_matches_single_process(runs: Path, ranks: int, stage: int) -> None:
    ref = json.loads((runs / "ref.0.json").read_text())
    got = result(runs / f"r{ranks}", stage)
    assert got[0]["world"] == ranks
    first3 = {"losses": ref["losses"][:3], "norms": ref["norms"][:3]}
    assert_same_training(got, (first3, np.load(runs / "ref.0.after3.npz")))


def test_zero3_with_recomputed_blocks_matches_single_process(runs: Path) -> None:
    """Activation checkpointing re-runs each block's forward inside backward: stage 3 must gather its parameters
    again for it, and the recomputation must not disturb the order of its gathers and reduce-scatters."""
    ref = json.loads((runs / "ref.0.json").read_text())
    got = result(runs / "recompute2", 3)
    assert got[0]["world"] == 2
    first3 = {"losses": ref["losses"][:3], "norms": ref["norms"][:3]}
    assert_same_training(got, (first3, np.load(runs / "ref.0.after3.npz")))


@pytest.mark.parametrize("loader", ["load4", "load1"], ids=["into-4-ranks", "into-one-process"])
def test_shards_saved_by_2_ranks_resume_in_another_layout(runs: Path, loader: str) -> None:
    ref = result(runs / "ref", 0)
    got = result(runs / loader, 2 if loader == "load4" else 0)
    tail = {"losses": ref[0]["losses"][3:], "norms": ref[0]["norms"][3:]}
    assert_same_training(got, (tail, ref[1]))


# ------------------------------------------------------------------------------------ blutrain train --parallel

TRAIN_TOML = """max_steps = 3
seq_len = 32
warmup_steps = 1
eval_every = 0
eval_batches = 1
sample_tokens = 2
model_overrides = { n_layer = 2, n_head = 2, n_embd = 32 }
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`blutrain train` alone with 8 rows per step, and under `blutrain run -n 2` with 4 rows per rank: ddp, zero=2
    (which also saves step 2 asynchronously, every rank its shard)."""
    d = tmp_path_factory.mktemp("train")
    (d / "c.toml").write_text(TRAIN_TOML)
    train = ["blutrain", "train", "--config", d / "c.toml"]
    proc = subprocess.run([sys.executable, "-m", "blutrain.cli", *map(str, train[1:]), "--batch-size", "8", "--out",
                           str(d / "one")], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    extra = {"zero=2": ["--async-checkpoint", "--checkpoint-every", "2"]}
    for mode in ("ddp", "zero=2"):
        launch(2, *train, "--parallel", mode, *extra.get(mode, []), "--batch-size", "4", "--out", d / mode)
    return d


def losses(directory: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["ddp", "zero=2"])
def test_blutrain_train_parallel_matches_one_process_with_the_same_global_batch(trained: Path, mode: str) -> None:
    one = losses(trained / "one")
    assert len(one) == 3
    np.testing.assert_allclose(losses(trained / mode), one, rtol=1e-5, atol=0)


def test_a_zero_checkpoint_is_one_file_per_rank_and_loads_whole_as_ddp_saved_it(trained: Path) -> None:
    assert sorted(p.name for p in (trained / "zero=2").glob("final*.safetensors")) == [
        "final.rank1-of-2.safetensors", "final.safetensors"]
    whole = load_any_checkpoint(trained / "zero=2" / "final.safetensors")
    ddp = load_checkpoint(trained / "ddp" / "final.safetensors")
    assert sorted(whole["model"]) == sorted(ddp["model"])
    for name, t in ddp["model"].items():
        np.testing.assert_allclose(whole["model"][name].numpy(), t.numpy(), rtol=0, atol=3e-5, err_msg=name)
    assert whole["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    for i, entry in ddp["optimizer"]["state"].items():
        merged = whole["optimizer"]["state"][int(i)]
        assert merged["step"] == entry["step"] == 3
        np.testing.assert_allclose(merged["exp_avg"].numpy(), entry["exp_avg"].numpy(), rtol=0, atol=1e-6)


def test_an_asynchronous_zero_checkpoint_has_every_ranks_shard(trained: Path) -> None:
    assert sorted(p.name for p in (trained / "zero=2").glob("step*.safetensors")) == [
        "step_000002.rank1-of-2.safetensors", "step_000002.safetensors"]
    state = load_any_checkpoint(trained / "zero=2" / "step_000002.safetensors")
    assert state["trainer"]["step"] == 2
    assert all(entry["step"] == 2 for entry in state["optimizer"]["state"].values())
