"""Tensor and context parallelism on 2 and 4 MPI ranks on the CPU, against the single-process run.

One `blutrain run` per world size runs every configuration in turn (dist_workers/tp_cp_gpt.py), so
the ranks start once: tp, async tp, cp with each attention (ring, all-gather, Ulysses), and on 4 ranks
the 2-D meshes dp × tp (sync and async), dp × cp and cp × tp (context parallelism over a tensor-parallel
model, ring and Ulysses). Each must give the single-process losses within
1e-5 and the same final parameters (gathered from the tensor-parallel shards); async tp must give the
synchronous tp's losses within 1e-6. Both runs also check the vocab-parallel cross-entropy, the three
attentions (in float64 and float32) and async TP's fused Linears, forward and backward, against float64.

`blutrain train --parallel dp=2,tp=2`, `dp=2,cp=2` and `cp=2,tp=2` under `blutrain run -n 4`, and the 3-D
`dp=2,cp=2,tp=2` under `blutrain run -n 8` (the trainer builds the mesh, shards the data by dp rank, clips with
the global gradient norm and saves state that merges into the single process's) must give the losses and
gradient norms of a single-process `blutrain train` with the same global batch, and a mesh that does not fit
the ranks is refused. Resuming under tp: test_dist_tp_checkpoint.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ranks import launch, load_worker

WORKER = Path(__file__).parent / "dist_workers" / "tp_cp_gpt.py"
CONFIGS = {
    2: ["tp", "tp-async", "cp-ring", "cp-allgather", "cp-ulysses"],
    4: ["tp", "tp-async", "cp-ring", "cp-ulysses", "dp-tp", "dp-tp-async", "dp-cp-ring", "dp-cp-allgather",
        "tpcp-ring", "tpcp-ulysses"],
}
UNITS = ["vocab_parallel_cross_entropy_float64", "vocab_parallel_cross_entropy_float32",
         *(f"attention_{kind}_{dtype}" for kind in ("ring", "allgather", "ulysses")
           for dtype in ("float64", "float32")),
         *(f"async_{kind}_linear_{chunks}_chunks_float64" for kind in ("row", "column") for chunks in (1, 3, 16))]


def _worker() -> Any:
    return load_worker(WORKER)


@pytest.fixture(scope="module")
def single_process() -> tuple[list[float], dict[str, Any]]:
    losses, params = _worker().train(None)
    return losses, params


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, list[Any]]]:
    """``job(n)``: the n-rank run (started once per module): its output prefix and every rank's results."""
    done: dict[int, tuple[Path, list[Any]]] = {}

    def run(n: int) -> tuple[Path, list[Any]]:
        if n not in done:
            prefix = tmp_path_factory.mktemp(f"tpcp{n}") / "out"
            launch(n, WORKER, "--out", prefix, "--units", "--configs", *CONFIGS[n], timeout=240)
            done[n] = prefix, [json.loads(Path(f"{prefix}.{r}.json").read_text()) for r in range(n)]
        return done[n]

    return run


@pytest.mark.parametrize("ranks", [2, 4], ids=["2ranks", "4ranks"])
def test_every_configuration_matches_the_single_process_run(single_process: tuple[list[float], dict[str, Any]],
                                                            job: Callable[[int], tuple[Path, list[Any]]],
                                                            ranks: int) -> None:
    prefix, results = job(ranks)
    ref_losses, ref_params = single_process
    for config in CONFIGS[ranks]:
        for rank, result in enumerate(results):
            assert result["world"] == ranks
            np.testing.assert_allclose(result["losses"][config], ref_losses, rtol=1e-5, atol=0,
                                       err_msg=f"{config}, rank {rank}")
        params = np.load(f"{prefix}.{config}.npz")
        assert sorted(params.files) == sorted(ref_params)
        for name, want in ref_params.items():
            assert params[name].shape == want.shape, f"{config}: {name}"
            # AdamW's normalized update turns float32 reduction-order noise in near-zero gradients into
            # differences of up to ~1e-5 after three steps (measured: 6e-6 to 9e-6); a missing reduction
            # or a wrong shard is off by ~1e-3 (the parameters move by ~1e-2)
            np.testing.assert_allclose(params[name], want, rtol=0, atol=2e-5, err_msg=f"{config}: {name}")


@pytest.mark.parametrize(("ranks", "sync"), [(2, "tp"), (4, "tp"), (4, "dp-tp")],
                         ids=["2ranks-tp", "4ranks-tp", "4ranks-dp-tp"])
def test_async_tp_matches_the_synchronous_layers(job: Callable[[int], tuple[Path, list[Any]]], ranks: int,
                                                 sync: str) -> None:
    prefix, results = job(ranks)
    for rank, result in enumerate(results):
        np.testing.assert_allclose(result["losses"][f"{sync}-async"], result["losses"][sync], rtol=1e-6, atol=0,
                                   err_msg=f"rank {rank}")
    got, want = np.load(f"{prefix}.{sync}-async.npz"), np.load(f"{prefix}.{sync}.npz")
    assert sorted(got.files) == sorted(want.files)
    for name in want.files:
        # the row blocks' GEMMs round as the whole GEMM does up to its blocking; AdamW's normalized update
        # turns that into at most ~8e-6 after three steps (measured); a lost or doubled block is ~1e-2 off
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5, err_msg=f"{sync}-async: {name}")


@pytest.mark.parametrize("ranks", [2, 4], ids=["2ranks", "4ranks"])
@pytest.mark.parametrize("check", UNITS)
def test_unit_check_matches_the_float64_reference_on_every_rank(job: Callable[[int], tuple[Path, list[Any]]],
                                                                check: str, ranks: int) -> None:
    _, results = job(ranks)
    for rank, result in enumerate(results):
        assert result["units"][check]["ok"], f"rank {rank}: {check}: {result['units'][check]}"


# ------------------------------------------------------------------------- blutrain train --parallel MESH

TRAIN_TOML = """max_steps = 3
seq_len = 32
warmup_steps = 1
eval_every = 0
eval_batches = 1
sample_tokens = 2
clip = 1.0
model_overrides = { n_layer = 2, n_head = 2, n_embd = 32 }
"""
MESHES = ["dp=2,tp=2", "dp=2,cp=2", "cp=2,tp=2", "dp=2,cp=2,tp=2"]


def _ranks(mesh: str) -> int:
    return math.prod(int(part.partition("=")[2]) for part in mesh.split(","))


def _blutrain(*args: str | Path, ranks: int = 0) -> subprocess.CompletedProcess[str]:
    launch = ["run", "-n", str(ranks), "--grace", "2", "--timeout", "60", "--", "blutrain"] if ranks else []
    return subprocess.run([sys.executable, "-m", "blutrain.cli", *launch, *map(str, args)], capture_output=True,
                          text=True, timeout=180)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`blutrain train` alone with 8 rows per step, and under `blutrain run -n 4` (8 for dp × cp × tp) with 4
    rows per data-parallel rank on each mesh with dp (cp × tp: every rank reads the 8); dp × cp also saves a step
    checkpoint asynchronously (rank 0 alone stages it: the others must not wait for it)."""
    d = tmp_path_factory.mktemp("mesh")
    (d / "c.toml").write_text(TRAIN_TOML)
    extra = {"dp=2,cp=2": ["--async-checkpoint", "--checkpoint-every", "2"]}
    # 8 rows a step in all: 4 per data-parallel rank where the mesh has dp=2, all 8 on every rank of cp × tp
    for ranks, rows, mesh in [(0, "8", None), *((_ranks(m), "4" if "dp=" in m else "8", m) for m in MESHES)]:
        parallel = ["--parallel", mesh, *extra.get(mesh, [])] if mesh else []
        proc = _blutrain("train", "--config", d / "c.toml", "--batch-size", rows, *parallel, "--out",
                         d / (mesh or "one"), ranks=ranks)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return d


def _metrics(directory: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mesh", MESHES)
def test_blutrain_train_on_a_mesh_matches_one_process_with_the_same_global_batch(trained: Path, mesh: str) -> None:
    one_norms = _metrics(trained / "one", "grad_norm")
    assert len(one_norms) == 3 and min(one_norms) > 1.0  # every step clips: the norm decides the update
    np.testing.assert_allclose(_metrics(trained / mesh, "loss"), _metrics(trained / "one", "loss"), rtol=1e-5, atol=0)
    # a replicated parameter counted once per tp rank, or a shard left out, moves the norm by > 10%
    np.testing.assert_allclose(_metrics(trained / mesh, "grad_norm"), one_norms, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mesh", MESHES)
def test_a_mesh_run_saves_the_whole_model_and_optimizer_state(trained: Path, mesh: str) -> None:
    from blutrain.train import load_checkpoint
    from blutrain.train.sharded import load_any_checkpoint

    one = load_checkpoint(trained / "one" / "final.safetensors")
    got = load_any_checkpoint(trained / mesh / "final.safetensors")  # dp × tp: one shard per tp rank
    assert sorted(got["model"]) == sorted(one["model"])
    for name, want in one["model"].items():
        assert got["model"][name].shape == want.shape, name
        np.testing.assert_allclose(got["model"][name].numpy(), want.numpy(), rtol=0, atol=3e-5, err_msg=name)
    assert got["optimizer"]["param_groups"] == one["optimizer"]["param_groups"]
    state = {str(i): entry for i, entry in got["optimizer"]["state"].items()}  # merged shards number by int
    for i, entry in one["optimizer"]["state"].items():
        assert state[i]["step"] == entry["step"] == 3
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(state[i][key].numpy(), entry[key].numpy(), rtol=0, atol=1e-6,
                                       err_msg=f"{i}.{key}")


def test_an_asynchronous_step_checkpoint_of_replicas_is_written_by_rank_0_alone(trained: Path) -> None:
    from blutrain.train import load_checkpoint

    state = load_checkpoint(trained / "dp=2,cp=2" / "step_000002.safetensors")
    assert state["trainer"]["step"] == 2
    assert sorted(p.name for p in (trained / "dp=2,cp=2").glob("*.safetensors")) == [
        "final.safetensors", "step_000002.safetensors"]


def test_a_mesh_that_does_not_fit_the_ranks_is_refused(tmp_path: Path) -> None:
    proc = _blutrain("train", "--parallel", "dp=2,tp=2", "--max-steps", "1", "--out", tmp_path, ranks=2)
    assert proc.returncode != 0
    assert "parallel 'dp=2,tp=2' lays out 4 ranks (dp 2 × tp 2), but this run has 2 rank(s)" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
