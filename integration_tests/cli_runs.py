"""Running the ``blutrain`` command as a user does, for the first-hour tests (test_first_hour*.py).

Each call is a real subprocess of this environment's interpreter (``python -m blutrain.cli``, what the console
script runs). ``QUICK`` is a configuration small enough that a run of a few steps takes seconds on two CPU
cores: a one-layer model, a short sample, one validation batch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

QUICK = """\
preset = "tiny"
device = "cpu"
batch_size = 2
seq_len = 16
max_steps = 3
warmup_steps = 1
eval_every = 0
eval_batches = 1
sample_tokens = 4
model_overrides = { n_layer = 1, n_head = 2, n_embd = 32, block_size = 32 }
"""


def blutrain_command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "blutrain.cli", *(str(a) for a in args)]


def user_env(**changes: str | None) -> dict[str, str]:
    """This process's environment with ``changes`` (None removes a variable)."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def blutrain(*args: str | Path, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(blutrain_command(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str], command: str = "train") -> str:
    """The error line of a failed command; asserts it is one line, with no traceback, and non-zero exit."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"blutrain {command}: "), lines[0]
    return lines[0]


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` by relative path → SHA-256 of its bytes (what "nothing changed" compares)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}
