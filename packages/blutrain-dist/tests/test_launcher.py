"""``blutrain.dist.launcher`` with plain Python ranks (no communication backend): environment,
exit codes, the failing rank named with its error, signals forwarded, nothing left running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from blutrain.dist import LaunchError
from blutrain.dist.launcher import Launcher, resolve_command


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for init to reap it is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "rank.py"
    path.write_text("import os, sys, time, signal, subprocess\nrank = int(os.environ['RANK'])\n" + body)
    return [sys.executable, str(path)]


def test_every_rank_gets_its_rank_world_and_store(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cmd = script(tmp_path, "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], "
                           "os.environ['BLUTRAIN_STORE'] == os.environ['MASTER_ADDR'] + ':' + "
                           "os.environ['MASTER_PORT'], os.environ['PMI_ID'])\n")
    assert Launcher(cmd, nproc=3).run() == 0
    lines = sorted(capfd.readouterr().out.split("\n"))[1:]
    assert lines == ["0 3 0 True 0", "1 3 1 True 1", "2 3 2 True 2"]


def test_a_rank_that_raises_is_named_with_its_error(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cmd = script(tmp_path, "if rank == 2: raise KeyError('no such shard')\ntime.sleep(60)\n")
    assert Launcher(cmd, nproc=3, grace=1).run() == 1
    err = capfd.readouterr().err
    assert "blutrain run: rank 2 (pid" in err and "exited with code 1: KeyError: 'no such shard'" in err
    assert "rank(s) 0, 1 had not failed and were stopped" in err


def test_the_exit_code_of_the_failed_rank_is_returned(tmp_path: Path) -> None:
    assert Launcher(script(tmp_path, "sys.exit(7 if rank == 1 else 0)\n"), nproc=2).run() == 7


def test_stopping_a_rank_stops_the_processes_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    cmd = script(tmp_path, f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                           f"open({str(pids)!r}, 'a').write(f'{{c.pid}}\\n')\n"
                           "time.sleep(0.5)\nif rank == 0: os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n")
    assert Launcher(cmd, nproc=2, grace=1).run() == 128 + signal.SIGKILL
    assert [pid for pid in map(int, pids.read_text().split()) if running(pid)] == []


def test_sigint_is_forwarded_and_reported(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cmd = script(tmp_path, "time.sleep(60)\n")
    launcher = Launcher(cmd, nproc=2, grace=1)
    threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    assert launcher.run() == 128 + signal.SIGINT
    assert time.monotonic() - start < 30
    assert "received SIGINT" in capfd.readouterr().err
    assert all(r.process.returncode is not None for r in launcher.ranks)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"nproc": 0}, "-n/--nproc must be an int >= 1, got 0"),
    ({"nproc": 1, "nnodes": 2}, "--master ADDR:PORT is required"),
    ({"nproc": 1, "nnodes": 2, "node_rank": 2, "master": "h:1"}, "--node-rank must be < --nnodes"),
    ({"nproc": 1, "master": "nohost"}, "--master must be ADDR:PORT"),
])
def test_bad_arguments_are_errors_naming_the_option(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        Launcher(["true"], **kwargs)  # type: ignore[arg-type]


def test_commands_resolve_scripts_and_blutrain_to_this_python() -> None:
    assert resolve_command(["--", "train.py", "--lr", "1"]) == [sys.executable, "train.py", "--lr", "1"]
    assert resolve_command(["blutrain", "train"]) == [sys.executable, "-m", "blutrain.cli", "train"]
    assert resolve_command(["hostname"]) == ["hostname"]
