"""Launching a worker script on N ranks with ``blutrain run`` and reading the JSON its rank 0 writes; and
the check that a compiled parallel run trained as its eager twin (dist_workers/compiled_runs.py reports both).

Shared by the multi-rank integration tests (pytest puts this directory on ``sys.path``: ``pythonpath`` in the
root pyproject.toml).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def launch(ranks: int, *command: str | Path, rank_timeout: int = 60, timeout: float = 180) -> None:
    """``blutrain run -n ranks -- command...``, checked to succeed (``rank_timeout``: ``blutrain run
    --timeout``; ``timeout``: the whole launch's); the tail of its stderr is the failure message."""
    cmd = [sys.executable, "-m", "blutrain.cli", "run", "-n", str(ranks), "--grace", "2", "--timeout",
           str(rank_timeout), "--", *map(str, command)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def run_worker(ranks: int, worker: Path, out: Path, *args: str, rank_timeout: int, timeout: int) -> dict[str, Any]:
    """``blutrain run -n ranks -- worker out args...``; its results, after checking the run succeeded on
    ``ranks`` ranks."""
    launch(ranks, worker, out, *args, rank_timeout=rank_timeout, timeout=timeout)
    found: dict[str, Any] = json.loads(out.read_text())
    assert found["world"] == ranks
    return found


def assert_trains_as_eager(got: dict[str, Any]) -> None:
    """One configuration of a compiled-parallel worker: the compiled run's losses, gradient norms and final
    parameters are the eager run's (to float32 rounding), from one trace."""
    import numpy as np

    compiled, eager = got["compiled"], got["eager"]
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(compiled["norms"], eager["norms"], rtol=1e-5, atol=0)
    assert got["param_diff"] < 1e-6
    assert compiled["traces"] == 1


def assert_merged_like_one_process(merged: dict[str, Any], one: dict[str, Any], steps: int) -> None:
    """A parallel run's checkpoint merged into whole state (``load_any_checkpoint``) against one process's after
    the same ``steps`` AdamW steps: the same tensors, parameters within 3e-5 (AdamW's normalized update turns
    float32 reduction-order noise into up to ~1e-5 after a few steps), the same groups, moments within 1e-6."""
    import numpy as np

    assert sorted(merged["model"]) == sorted(one["model"])
    for name, want in one["model"].items():
        assert merged["model"][name].shape == want.shape, name
        np.testing.assert_allclose(merged["model"][name].numpy(), want.numpy(), rtol=0, atol=3e-5, err_msg=name)
    assert merged["optimizer"]["param_groups"] == one["optimizer"]["param_groups"]
    for i, entry in one["optimizer"]["state"].items():
        state = merged["optimizer"]["state"][int(i)]
        assert state["step"] == entry["step"] == steps
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(state[key].numpy(), entry[key].numpy(), rtol=0, atol=1e-6,
                                       err_msg=f"{i}.{key}")


def load_worker(path: Path) -> Any:
    """A worker script imported as a module (its helpers and constants, without running it), named after its
    file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
