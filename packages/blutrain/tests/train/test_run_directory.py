"""The run directory: default names, the runs/latest link, refusals, and metrics.jsonl of a resumed run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blutrain.dist import RUN_ID_ENV
from blutrain.train import ConfigError
from blutrain.train.run_directory import (
    MetricsLog,
    check_run_directory,
    default_run_directory,
    point_latest,
    prepare_run_directory,
    run_files,
)


def _write_rows(path: Path, steps: list[int]) -> None:
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps))


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_default_directories_are_new_each_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (RUN_ID_ENV, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    first = default_run_directory(root=tmp_path)
    first.mkdir()
    second = default_run_directory(root=tmp_path)
    assert second != first and second.parent == tmp_path and not second.exists()


def test_the_ranks_of_a_job_share_the_launchers_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUN_ID_ENV, "20260101-120000")
    assert default_run_directory(world_size=4, root=tmp_path) == tmp_path / "20260101-120000"


def test_the_tasks_of_a_slurm_job_share_its_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert default_run_directory(world_size=8, root=tmp_path) == tmp_path / "slurm-4242.0"


def test_ranks_without_a_run_id_must_name_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (RUN_ID_ENV, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="give --out DIR"):
        default_run_directory(world_size=2, root=tmp_path)


def test_latest_points_at_the_newest_run_and_leaves_a_real_directory_alone(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert point_latest(a, root=tmp_path) == tmp_path / "latest"
    point_latest(b, root=tmp_path)
    assert (tmp_path / "latest").resolve() == b.resolve()
    assert list(tmp_path.glob(".latest*")) == []  # no temporary link left behind
    other = tmp_path / "other"
    (other / "latest").mkdir(parents=True)
    assert point_latest(a, root=other) is None and (other / "latest").is_dir()


def test_a_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", "config.toml", "step_000002.safetensors", "step_000002.rank1-of-2.safetensors"):
        (out / name).write_text(name)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"already holds a run.*--resume.*--overwrite"):
        prepare_run_directory(out, resuming=False, overwrite=False)
    assert prepare_run_directory(out, resuming=True, overwrite=False) == []
    assert len(run_files(out)) == 4
    removed = prepare_run_directory(out, resuming=False, overwrite=True)
    assert len(removed) == 4 and run_files(out) == [] and (out / "notes.txt").read_text() == "mine"


def test_a_resume_that_writes_no_row_leaves_the_metrics_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [1, 2, 3, 4])
    before = path.read_bytes()
    with MetricsLog(path, resumed_step=2):
        pass  # e.g. out of memory in the first resumed step
    assert path.read_bytes() == before


def test_a_resume_drops_the_rows_after_its_step_at_its_first_row(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [1, 2, 3, 4])
    with path.open("a") as f:
        f.write('{"step": 5, "lo')  # a row cut short by a kill
    with MetricsLog(path, resumed_step=2) as log:
        assert log.write({"step": 3, "loss": 0.5}) == 3
        assert log.write({"step": 4, "loss": 0.25}) == 0
    assert _steps(path) == [1, 2, 3, 4]
    assert json.loads(path.read_text().splitlines()[2])["loss"] == 0.5


def test_a_new_run_starts_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, resumed_step=None) as log:
        log.write({"step": 1, "loss": 2.0})
    assert _steps(path) == [1]


def test_checking_a_run_directory_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    assert check_run_directory(out, resuming=False, overwrite=False) == []
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write the run directory .* is a file"):
        check_run_directory(tmp_path / "file" / "run", resuming=False, overwrite=False)
