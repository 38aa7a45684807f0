"""Ctrl-C (SIGINT) and Slurm's preemption (SIGTERM) during ``blutrain train`` lose no work (issue 27).

A real training process gets the signal mid-run; it must finish the step it is in, write a checkpoint of
that step and the loss plot, say in one line how to resume, and exit with 128 + the signal. Resuming then
continues the run, and metrics.jsonl ends with every step exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from blutrain_cli import blutrain, command_line, quick_workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quick_workdir(tmp_path_factory.mktemp("signals"))


def _interrupt_line(proc: subprocess.CompletedProcess[str], status: int) -> str:
    """The one line an interrupted ``blutrain train`` prints: exit 128 + the signal, no traceback."""
    assert proc.returncode == status, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blutrain train: "), proc.stderr
    return lines[0]


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _interrupt(workdir: Path, out: Path, sig: signal.Signals, after_steps: int, *extra: str) -> tuple[
        subprocess.CompletedProcess[str], int]:
    """Start a long run into ``out``, send ``sig`` once ``after_steps`` steps are in metrics.jsonl, and wait
    for it to exit; returns the finished process and the number of steps it had logged when signalled."""
    cmd = command_line("train", "--config", "quick.toml", "--data", "data", "--max-steps", "100000",
                       "--out", out, *extra)
    proc, logs = _start(cmd, workdir, out.parent)
    try:
        _wait_for_steps(proc, out, after_steps, logs)
        seen = len(_steps(out))
        proc.send_signal(sig)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, *(p.read_text() for p in logs)), seen


def _start(cmd: list[str], cwd: Path, logs: Path) -> tuple[subprocess.Popen[bytes], tuple[Path, Path]]:
    """``cmd`` started with its output in files (a pipe nobody reads while it runs could fill and stall it)."""
    stdout, stderr = logs / "stdout.txt", logs / "stderr.txt"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err), (stdout, stderr)


def _wait_for_steps(proc: subprocess.Popen[bytes], out: Path, steps: int, logs: tuple[Path, Path]) -> None:
    deadline = time.monotonic() + 300
    while len(_steps(out)) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the run did not reach step {steps} (exit {proc.returncode}):\n"
                                 + "\n".join(p.read_text() for p in logs))
        time.sleep(0.05)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_interrupted_step_and_resumes(workdir: Path, tmp_path: Path, sig: signal.Signals,
                                                             status: int) -> None:
    out = tmp_path / "run"
    stopped, seen = _interrupt(workdir, out, sig, 3)
    line = _interrupt_line(stopped, status)
    assert f"{sig.name} received" in line and "resume with: blutrain train" in line
    steps = _steps(out)
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last >= seen  # the step in flight was finished, not lost
    checkpoint = out / f"step_{last:06d}.safetensors"
    assert checkpoint.is_file() and str(checkpoint) in line
    assert (out / "loss.png").is_file()

    # the command the message gives, with a short horizon so that the test ends
    resume = line.split("resume with: ", 1)[1].split()
    assert resume[:2] == ["blutrain", "train"]
    resumed = blutrain(*resume[1:], "--max-steps", str(last + 2), cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint} at step {last}" in resumed.stdout
    assert _steps(out) == list(range(1, last + 3))
    assert (out / "final.safetensors").is_file()


def test_resuming_an_earlier_checkpoint_leaves_no_duplicate_rows(workdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    stopped, _ = _interrupt(workdir, out, signal.SIGTERM, 5, "--checkpoint-every", "2", "--keep", "0")
    assert stopped.returncode == 143, stopped.stderr
    last = _steps(out)[-1]
    resumed = blutrain("train", "--config", "quick.toml", "--data", "data", "--max-steps", str(last + 1),
                       "--resume", out / "step_000002.safetensors", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"dropped {last - 2} row(s) after step 2" in resumed.stdout
    assert _steps(out) == list(range(1, last + 2))  # steps 3..last trained again and written once


def test_sigint_to_blutrain_run_stops_every_rank_after_the_same_step(workdir: Path, tmp_path: Path) -> None:
    pytest.importorskip("blutrain_comm_mpi")
    pytest.importorskip("blutrain_parallel_ddp")
    out = tmp_path / "ddp"
    train = ["--", "blutrain", "train", "--config", "quick.toml", "--data", "data", "--parallel", "ddp",
             "--dist-backend", "mpi", "--max-steps", "100000", "--out", str(out)]
    cmd = command_line("run", "-n", "2", "--grace", "20", *train)
    proc, logs = _start(cmd, workdir, tmp_path)
    try:
        _wait_for_steps(proc, out, 2, logs)
        proc.send_signal(signal.SIGINT)  # as Ctrl-C in the terminal of `blutrain run`
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = logs[1].read_text()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    last = _steps(out)[-1]
    assert _steps(out) == list(range(1, last + 1))
    assert (out / f"step_{last:06d}.safetensors").is_file()
    for rank in (0, 1):  # each rank stopped after the same step and said how to resume
        assert f"[rank{rank}]: blutrain train: SIGINT received: stopped after step {last} of 100000" in stderr, stderr
    resumed = blutrain("run", "-n", "2", *train[:-4], "--max-steps", str(last + 1), "--out", str(out), "--resume",
                       out / f"step_{last:06d}.safetensors", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(out) == list(range(1, last + 2))
