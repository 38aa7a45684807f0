"""Wheels and fresh virtual environments for the tests that install BluTrain as a user would.

Shared by test_packaging.py and test_new_user.py (pytest puts this directory on ``sys.path``: ``pythonpath``
in the root pyproject.toml); the wheels are built once per session by the ``wheels`` fixture of conftest.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")
MEMBERS = sorted(
    p.name for d in ("packages", "plugins") for p in (ROOT / d).iterdir() if (p / "pyproject.toml").exists()
)


def run(*cmd: str | Path, env: dict[str, str] | None = None, check: bool = True,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` outside this environment (no VIRTUAL_ENV, no Python downloads); raise with its output
    when ``check`` and it fails."""
    full_env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", **(env or {})}
    full_env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=full_env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def build_wheels(out: Path) -> Path:
    """One wheel per package and plugin of the workspace, into ``out``."""
    assert UV is not None
    run(UV, "build", "--all-packages", "--wheel", "--out-dir", out, cwd=ROOT)
    return out


def make_venv(path: Path) -> Path:
    """A fresh virtual environment on this interpreter; returns its python."""
    assert UV is not None
    run(UV, "venv", "--python", sys.executable, path)
    return path / "bin" / "python"


def install(python: Path, *targets: str | Path) -> None:
    assert UV is not None
    run(UV, "pip", "install", "--python", python, *targets)


def uninstall(python: Path, *names: str) -> None:
    assert UV is not None
    run(UV, "pip", "uninstall", "--python", python, *names)


def wheel_of(wheels: Path, dist: str) -> Path:
    found = sorted(wheels.glob(dist.replace("-", "_") + "-*.whl"))
    assert len(found) == 1, f"expected one wheel for {dist}, found {found}"
    return found[0]
