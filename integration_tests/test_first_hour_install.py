"""``pip install blutrain`` alone, then ``blutrain train`` (issue 27): what is missing is named with its package.

The facade is installed from the workspace's wheels into a fresh virtual environment with its dependencies
and no plugin; the command must say in one line which package provides the optimizer it needs. With
blutrain-autograd uninstalled as well, it must name that package instead of printing a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from blutrain_cli import QUICK_RUN_TOML, one_line_error
from venvs import UV, install, make_venv, run, uninstall, wheel_of

pytestmark = [pytest.mark.slow, pytest.mark.skipif(UV is None, reason="uv is not on PATH")]

FACADE = ("blutrain", "blutrain-tensor", "blutrain-autograd", "blutrain-kernels", "blutrain-alloc", "blutrain-dist",
          "blutrain-compiler")


def _facade_venv(wheels: Path, root: Path) -> Path:
    """A virtual environment under ``root`` with the blutrain facade and its dependencies, no plugin; returns
    its python (``root`` also holds quick.toml)."""
    python = make_venv(root / "venv")
    install(python, *(wheel_of(wheels, dist) for dist in FACADE))
    (root / "quick.toml").write_text(QUICK_RUN_TOML)
    return python


@pytest.fixture
def facade_alone(wheels: Path, tmp_path: Path) -> Path:
    return _facade_venv(wheels, tmp_path)


def test_train_without_an_optimizer_plugin_names_the_package(facade_alone: Path) -> None:
    cwd = facade_alone.parent.parent.parent
    proc = run(facade_alone.parent / "blutrain", "train", "--config", "quick.toml", "--out", "runs/a", check=False,
               cwd=cwd)
    line = one_line_error(proc, "train")
    assert "no optimizer 'adamw'" in line and "install blutrain-optim-adamw" in line
    assert not (cwd / "runs" / "a" / "metrics.jsonl").exists()


def test_train_without_autograd_names_the_package(facade_alone: Path) -> None:
    cwd = facade_alone.parent.parent.parent
    uninstall(facade_alone, "blutrain-autograd")
    proc = run(facade_alone.parent / "blutrain", "train", "--config", "quick.toml", "--out", "runs/b", check=False,
               cwd=cwd)
    line = one_line_error(proc, "train")
    assert "blutrain-autograd" in line and "pip install blutrain-autograd" in line
