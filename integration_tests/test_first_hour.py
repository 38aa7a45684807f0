"""A user's first hour with ``blutrain train`` (issue 27): mistakes get one line, runs are never lost.

Every test runs the command as a user does (a subprocess) and checks the exit code, that a mistake is
reported in one line with no traceback, and that nothing already on disk was changed or lost.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest
from blutrain_cli import QUICK_RUN_TOML, blutrain, one_line_error, quick_workdir, tree_digest

from blutrain.dist import launcher


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with quick.toml and data/ (byte shards of a few stdlib files, train and val)."""
    return quick_workdir(tmp_path_factory.mktemp("first-hour"))


@pytest.fixture(scope="module")
def finished_run(workdir: Path) -> Path:
    """A finished 3-step run in runs/done (read-only for the tests that use it)."""
    out = workdir / "runs" / "done"
    proc = blutrain("train", "--config", "quick.toml", "--data", "data", "--out", out, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    return out


def _rows(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- point 3: a user's mistake is one line ---------------------------------------------------------------
def test_data_that_does_not_exist_is_one_line(workdir: Path) -> None:
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "/nope", "--out", "runs/nope",
                                   cwd=workdir), "train")
    assert "'/nope'" in line and "expected a directory or a glob" in line
    assert not (workdir / "runs" / "nope" / "metrics.jsonl").exists()


def test_a_text_file_named_bin_points_to_prepare(workdir: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.bin"
    text.write_text("hello, these are notes, not tokens\n" * 100)
    before = tree_digest(tmp_path)
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", text, "--out", tmp_path / "run",
                                   cwd=workdir), "train")
    assert "notes.bin" in line and "blutrain prepare" in line
    assert tree_digest(tmp_path) == before


def test_a_shard_too_small_for_one_step_names_the_flags(workdir: Path) -> None:
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--batch-size", "4096",
                                   "--seq-len", "32", "--out", "runs/small", cwd=workdir), "train")
    assert "fewer than one step needs" in line and "--batch-size" in line


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len"])
def test_resuming_with_another_batch_shape_is_refused(workdir: Path, finished_run: Path, flag: str) -> None:
    before = tree_digest(finished_run)
    value = "3" if flag == "--batch-size" else "8"
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", flag, value, "--max-steps",
                                   "5", "--resume", finished_run / "final.safetensors", cwd=workdir), "train")
    assert "resume:" in line and flag in line and "config.toml" in line
    assert tree_digest(finished_run) == before


def test_resuming_with_another_optimizer_is_refused(workdir: Path, finished_run: Path) -> None:
    before = tree_digest(finished_run)
    proc = blutrain("train", "--config", "quick.toml", "--data", "data", "--optimizer", "sgd", "--max-steps", "5",
                    "--resume", finished_run / "final.safetensors", cwd=workdir)
    line = one_line_error(proc, "train")
    assert "'adamw'" in line and "--optimizer sgd" in line and "--optimizer adamw" in line
    assert tree_digest(finished_run) == before


def test_out_that_is_a_file_is_refused_and_kept(workdir: Path, tmp_path: Path) -> None:
    target = tmp_path / "results.txt"
    target.write_text("my results\n")
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--out", target,
                                   cwd=workdir), "train")
    assert "is a file" in line and "--out" in line
    assert target.read_text() == "my results\n"


def test_out_that_cannot_be_written_is_refused(workdir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--out", blocker / "run",
                                   cwd=workdir), "train")
    assert "cannot write the run directory" in line and "--out" in line


def test_cuda_without_cupy_is_one_line(workdir: Path) -> None:
    pytest.importorskip("blutrain_backend_cupy")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here: the case is a machine without it")
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--device", "cuda",
                                   "--out", "runs/cuda", cwd=workdir), "train")
    assert "device 'cuda'" in line and "CuPy is not installed" in line and "--device cpu" in line


def test_an_unknown_logger_names_its_package(workdir: Path) -> None:
    env = {**os.environ, "BLUTRAIN_DISABLE_PLUGINS": "tensorboard"}
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--log", "tensorboard",
                                   "--out", "runs/tb", cwd=workdir, env=env), "train")
    assert "no logger 'tensorboard'" in line and "BLUTRAIN_DISABLE_PLUGINS" in line
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--log", "wandb",
                                   "--out", "runs/wandb", cwd=workdir), "train")
    assert "no logger 'wandb'" in line and "csv" in line


# -- point 4: a run directory is never silently overwritten ----------------------------------------------
def test_training_again_into_a_run_is_refused_naming_resume_and_overwrite(workdir: Path, finished_run: Path) -> None:
    before = tree_digest(finished_run)
    line = one_line_error(blutrain("train", "--config", "quick.toml", "--data", "data", "--out", finished_run,
                                   cwd=workdir), "train")
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert tree_digest(finished_run) == before


def test_overwrite_removes_the_old_run_step_checkpoints_included(workdir: Path) -> None:
    out = workdir / "runs" / "overwritten"
    first = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "4", "--checkpoint-every",
                     "1", "--keep", "0", "--out", out, cwd=workdir)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in out.glob("step_*")) == [f"step_00000{i}.safetensors" for i in (1, 2, 3)]
    (out / "notes.txt").write_text("mine")  # not a run's file: kept
    again = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "2", "--overwrite",
                     "--out", out, cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "--overwrite: removed the previous run's" in again.stdout
    assert not list(out.glob("step_*")), "the old run's step checkpoints must go"
    assert [m["step"] for m in _rows(out)] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"
    assert "overwrite" not in (out / "config.toml").read_text()  # running it again cannot delete this run


def test_overwrite_with_a_refused_configuration_deletes_nothing(workdir: Path, finished_run: Path) -> None:
    before = tree_digest(finished_run)
    proc = blutrain("train", "--config", "quick.toml", "--data", "/nope", "--overwrite", "--out", finished_run,
                    cwd=workdir)
    one_line_error(proc, "train", "/nope")
    assert tree_digest(finished_run) == before  # the old run goes only once the new one can start


def test_plain_train_twice_keeps_both_runs_and_links_the_latest(workdir: Path, tmp_path: Path) -> None:
    (tmp_path / "quick.toml").write_text(QUICK_RUN_TOML)
    runs = []
    for _ in range(2):
        proc = blutrain("train", "--config", "quick.toml", "--data", workdir / "data", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        runs.append(sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()))
    assert len(runs[0]) == 1 and len(runs[1]) == 2
    newest = (set(runs[1]) - set(runs[0])).pop()
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and latest.resolve() == newest.resolve()
    for run in runs[1]:
        assert [m["step"] for m in _rows(run)] == [1, 2, 3]
        assert (run / "final.safetensors").is_file()


def test_resume_without_out_continues_in_the_checkpoints_directory(workdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "3", "--checkpoint-every",
                     "2", "--out", out, cwd=workdir)
    assert first.returncode == 0, first.stderr
    resumed = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "4", "--resume",
                       out / "step_000002.safetensors", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert "dropped 1 row(s) after step 2" in resumed.stdout
    assert [m["step"] for m in _rows(out)] == [1, 2, 3, 4]  # step 3 trained again, written once


# -- point 10: validation on its own line and in metrics.jsonl; --keep bounded by default -----------------
def test_validation_loss_has_its_own_line_and_is_in_the_metrics(workdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "4", "--eval-every", "2",
                    "--out", out, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(out)
    assert [m["step"] for m in rows if "val_loss" in m] == [2, 4]  # the last step's (final) evaluation too
    for m in rows:
        if "val_loss" in m:
            assert f"step {m['step']}: validation loss {m['val_loss']:.4f}" in proc.stdout.splitlines()


def test_keep_defaults_to_the_three_newest_step_checkpoints(workdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "7", "--checkpoint-every",
                    "1", "--out", out, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("step_*")) == [f"step_00000{i}.safetensors" for i in (4, 5, 6)]


def test_plugins_check_prints_no_runtime_warning(workdir: Path) -> None:
    proc = blutrain("plugins", "--check", "--device", "cpu", "--op", "linear_cross_entropy", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# -- point 6: each rank of `blutrain run` gets its share of the cores ------------------------------------
# one write of the whole line: print() writes the text and its newline separately, and the two ranks share the
# launcher's stdout, so two lines could come out as one ('{...}{...}') on a busy machine
PRINT_THREADS = ("import json, os, sys; sys.stdout.write(json.dumps({k: os.environ.get(k) for k in "
                 + repr(launcher.THREAD_ENVS) + "}) + '\\n'); sys.stdout.flush()")


def _rank_threads(workdir: Path, env: dict[str, str]) -> list[dict[str, str | None]]:
    proc = blutrain("run", "-n", "2", "--", "-c", PRINT_THREADS, cwd=workdir, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, proc.stdout
    return ranks


def test_run_gives_each_rank_its_share_of_the_cores(workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in launcher.THREAD_ENVS}
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for rank in _rank_threads(workdir, env):
        assert rank == dict.fromkeys(launcher.THREAD_ENVS, share)


def test_run_leaves_the_users_thread_settings_alone(workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in launcher.THREAD_ENVS}
    env |= {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}
    for rank in _rank_threads(workdir, env):
        assert rank == {**dict.fromkeys(launcher.THREAD_ENVS, "3"), "MKL_NUM_THREADS": "5"}


# -- loggers: --log csv,tensorboard ----------------------------------------------------------------------
def test_log_csv_and_tensorboard_write_what_metrics_jsonl_holds(workdir: Path, tmp_path: Path) -> None:
    tensorboard = pytest.importorskip("blutrain_logger_tensorboard")
    out = tmp_path / "run"
    proc = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", "4", "--eval-every", "2",
                    "--log", "csv,tensorboard", "--out", out, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(out)
    with open(out / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == [m["step"] for m in rows]
    for r, m in zip(table, rows, strict=True):
        assert {k: float(v) for k, v in r.items() if v} == {k: float(v) for k, v in m.items()}  # type: ignore[arg-type]
    scalars = tensorboard.read_scalars(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["val/loss"]] == [2, 4]
    for (_, value), m in zip(scalars["train/loss"], rows, strict=True):
        assert math.isclose(value, m["loss"], rel_tol=1e-6)  # type: ignore[arg-type]
