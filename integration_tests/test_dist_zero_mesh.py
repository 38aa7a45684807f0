"""ZeRO along the data-parallel dimension of a device mesh on 4 MPI ranks on the CPU, against the single process.

`--parallel dp=2,tp=2,zero=STAGE` (stages 1, 2 and 3: ZeRO shards each rank's tensor-parallel blocks over dp)
and `dp=2,cp=2,zero=1` (ZeRO over dp × cp, the ranks that hold replicas), eager and compiled, all in one
`blutrain run -n 4` (dist_workers/train_runs.py): each must give the losses and gradient norms of one process
training the same global batch (8 rows a step) within 1e-5, and save a checkpoint (one file per rank: ZeRO's
shards of tp's blocks are windows of tp's ranges) that merges into the single process's state; so must
`dp=2,cp=2,tp=2,zero=2` on 8 ranks (eagerly). Checkpoints
resume across layouts: the same mesh, another ZeRO stage, dp × cp from dp × tp's shards, DDP over tp from
ZeRO's, ZeRO from a single-process checkpoint, and one process from ZeRO over tp; every resumed run continues
the uninterrupted losses within 1e-5. A malformed mesh is refused in one line before any rank starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ranks import assert_merged_like_one_process, launch, load_worker

WORKER = Path(__file__).parent / "dist_workers" / "train_runs.py"
MESHES = ["dp=2,tp=2,zero=1", "dp=2,tp=2,zero=2", "dp=2,tp=2,zero=3", "dp=2,cp=2,zero=1"]
MESH_8 = "dp=2,cp=2,tp=2,zero=2"  # the 3-D mesh, on 8 ranks: ZeRO over dp × cp, nested over tp
SOURCE = "dp=2,tp=2,zero=2"  # the run whose step-2 checkpoint the resumed runs start from
# resumed run → (its --parallel, the checkpoint it resumes: a run's directory, at step 2)
RESUMED = {"same-mesh": (SOURCE, SOURCE), "another-stage": ("dp=2,tp=2,zero=3", SOURCE),
           "dp-cp-from-dp-tp": ("dp=2,cp=2,zero=1", SOURCE), "ddp-tp-from-zero": ("dp=2,tp=2", "dp=2,tp=2,zero=1"),
           "zero-from-one": ("dp=2,tp=2,zero=1", "one")}


def _worker() -> Any:
    return load_worker(WORKER)


def _step2(d: Path, run: str) -> str:
    return str(d / run / "step_000002.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process with 8 rows a step (a checkpoint after step 2), then on 4 ranks, 4 rows per data-parallel
    rank: each mesh eagerly (checkpoints after step 2; dp × cp asynchronously) and compiled, then the resumed
    runs; then one process resumed from ZeRO over tp's shards."""
    d = tmp_path_factory.mktemp("zeromesh")
    worker = _worker()
    worker.train({"out": str(d / "one"), "batch_size": 8, "checkpoint_every": 2})
    spec: list[dict[str, Any]] = []
    for mesh in MESHES:
        spec.append({"out": str(d / mesh), "batch_size": 4, "parallel": mesh, "checkpoint_every": 2,
                     "async_checkpoint": "cp=" in mesh})
    for mesh in MESHES:
        spec.append({"out": str(d / f"{mesh}-compiled"), "batch_size": 4, "parallel": mesh, "compile": True})
    for name, (mesh, source) in RESUMED.items():
        spec.append({"out": str(d / name), "batch_size": 4, "parallel": mesh, "resume": _step2(d, source)})
    (d / "spec.json").write_text(json.dumps(spec))
    launch(4, WORKER, d / "spec.json", rank_timeout=240, timeout=400)
    (d / "spec8.json").write_text(json.dumps([{"out": str(d / MESH_8), "batch_size": 4, "parallel": MESH_8}]))
    launch(8, WORKER, d / "spec8.json", rank_timeout=240, timeout=400)
    worker.train({"out": str(d / "one-from-zero"), "batch_size": 8, "resume": _step2(d, "dp=2,tp=2,zero=3")})
    return d


def _metrics(directory: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mesh", MESHES)
def test_zero_on_a_mesh_gives_the_single_process_losses_and_norms(runs: Path, mesh: str, compiled: bool) -> None:
    one_norms = _metrics(runs / "one", "grad_norm")
    assert len(one_norms) == 4 and min(one_norms[:3]) > 1.0  # the first steps clip: the norm decides the update
    run = runs / (f"{mesh}-compiled" if compiled else mesh)
    np.testing.assert_allclose(_metrics(run, "loss"), _metrics(runs / "one", "loss"), rtol=1e-5, atol=0)
    # a replicated tensor counted once per tp rank, or a shard left out, moves the norm by > 10%
    np.testing.assert_allclose(_metrics(run, "grad_norm"), one_norms, rtol=1e-5, atol=0)


def test_zero_on_the_3d_mesh_gives_the_single_process_losses_and_norms(runs: Path) -> None:
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(_metrics(runs / MESH_8, key), _metrics(runs / "one", key), rtol=1e-5, atol=0)


@pytest.mark.parametrize("mesh", [*MESHES, MESH_8])
def test_a_zero_mesh_checkpoint_merges_into_the_single_process_state(runs: Path, mesh: str) -> None:
    from blutrain.train import load_checkpoint
    from blutrain.train.sharded import load_any_checkpoint

    # every rank holds a different part: one file each (dp × tp: ZeRO's shards of tp's blocks; dp × cp: ZeRO's)
    n = 8 if mesh == MESH_8 else 4
    assert sorted(p.name for p in (runs / mesh).glob("final*.safetensors")) == [
        *(f"final.rank{r}-of-{n}.safetensors" for r in range(1, n)), "final.safetensors"]
    assert_merged_like_one_process(load_any_checkpoint(runs / mesh / "final.safetensors"),
                                   load_checkpoint(runs / "one" / "final.safetensors"), steps=4)


def test_zero_over_tp_writes_windows_of_the_tp_ranges(runs: Path) -> None:
    from blutrain.train import load_checkpoint

    index = load_checkpoint(runs / "dp=2,tp=2,zero=1" / "final.safetensors")["optimizer"]["sharded"]
    assert index["format"] == "blutrain-sharded-2"
    assert index["windows"]  # a ZeRO shard that cuts a tp block holds part of its piece


@pytest.mark.parametrize("resumed", [*RESUMED, "one-from-zero"])
def test_a_resumed_run_continues_the_uninterrupted_losses(runs: Path, resumed: str) -> None:
    got = _metrics(runs / resumed, "loss")
    assert len(got) == 2
    np.testing.assert_allclose(got, _metrics(runs / "one", "loss")[2:], rtol=1e-5, atol=0)


@pytest.mark.parametrize(("parallel", "message"), [
    ("dp=2,tp=2,zero=4", "parallel 'dp=2,tp=2,zero=4': ZeRO: stage must be 1, 2 or 3, got 4"),
    ("tp=2,zero=1", "parallel 'tp=2,zero=1': zero=1 runs along dp, which the mesh does not size"),
])
def test_a_malformed_zero_mesh_is_refused_in_one_line(tmp_path: Path, parallel: str, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "train", "--parallel", parallel, "--max-steps", "1",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
