"""Acceptance: a new user follows docs/plugin-guide.md, and only it, to add an optimizer.

The plugin's files are the guide's ``<!-- file: ... -->`` blocks, written as printed into an empty directory.
They are installed with the workspace's wheels into a fresh virtual environment; the plugin must then be
listed by ``blutrain plugins`` and train by name with ``blutrain train --optimizer NAME``, which must run the
plugin's class (its parameter groups hold its hyperparameters, not another optimizer's).
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
from doc_blocks import read_blocks
from venvs import UV, install, make_venv, run

pytestmark = [pytest.mark.slow, pytest.mark.skipif(UV is None, reason="uv is not on PATH")]


def write_guide_files(root: Path) -> dict[str, Path]:
    """The plugin guide's files, written under ``root``; returns them by their path in the guide."""
    blocks = [b for b in read_blocks("plugin-guide.md") if b.marker == "file"]
    assert blocks, "docs/plugin-guide.md has no <!-- file: ... --> blocks"
    written = {}
    for block in blocks:
        path = root / block.arg
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.code)
        written[block.arg] = path
    return written


def test_a_new_user_writes_installs_and_trains_with_an_optimizer_plugin(wheels: Path, tmp_path: Path) -> None:
    files = write_guide_files(tmp_path / "work")
    (pyproject,) = [p for rel, p in files.items() if rel.endswith("pyproject.toml")]
    project = tomllib.loads(pyproject.read_text())["project"]
    ((name, module),) = project["entry-points"]["blutrain"].items()

    python = make_venv(tmp_path / "venv")
    install(python, *sorted(wheels.glob("*.whl")))
    install(python, pyproject.parent)
    blutrain = python.parent / "blutrain"

    listing = run(blutrain, "plugins").stdout
    assert f"\n{name}  [entry point]  {project['name']} {project['version']}\n" in listing, listing
    assert f"blutrain_register_optimizers: {name}" in listing

    out = tmp_path / "run"
    trained = run(blutrain, "train", "--optimizer", name, "--lr", "1e-3", "--max-steps", "3", "--batch-size", "2",
                  "--seq-len", "32", "--eval-every", "0", "--out", out, cwd=tmp_path)
    assert f"on cpu, {name}," in trained.stdout, trained.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
    assert f'optimizer = "{name}"' in (out / "config.toml").read_text()

    probe = (f"import json, {module}; from blutrain.train import load_checkpoint; "
             "state = load_checkpoint('final.safetensors'); "
             "print(json.dumps(sorted(k for g in state['optimizer']['param_groups'] for k in g)))")
    keys = set(json.loads(run(python, "-c", probe, cwd=out).stdout))
    assert keys == {"lr", "params", "weight_decay"}, keys  # the guide's class: no betas or momentum
