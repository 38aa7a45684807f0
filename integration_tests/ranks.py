"""Launching a worker script on N ranks with ``blutrain run`` and reading the JSON its rank 0 writes.

Shared by the compiled-parallel tests (pytest puts this directory on ``sys.path``: ``pythonpath`` in the
root pyproject.toml).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_worker(ranks: int, worker: Path, out: Path, *args: str, rank_timeout: int, timeout: int) -> dict[str, Any]:
    """``blutrain run -n ranks -- worker out args...``; its results, after checking the run succeeded on
    ``ranks`` ranks (``rank_timeout``: ``blutrain run --timeout``; ``timeout``: the whole launch's)."""
    cmd = [sys.executable, "-m", "blutrain.cli", "run", "-n", str(ranks), "--grace", "2", "--timeout",
           str(rank_timeout), "--", str(worker), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found: dict[str, Any] = json.loads(out.read_text())
    assert found["world"] == ranks
    return found
