"""The ``blutrain`` command run as a user runs it (a subprocess of this environment's interpreter), and the
checks every user-facing CLI test makes of its outcome.

Shared by the test_cli_*.py files (pytest puts this directory on ``sys.path``: ``pythonpath`` in the root
pyproject.toml). Each run gets an empty tiktoken cache, so a test sees only the tokenizer files it wrote.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

# A model small enough that a CLI run of a few steps takes seconds even with GPT-2's 50,257-token vocabulary;
# and a short end of run (the sample, the validation batches).
SMALL_RUN_TOML = """\
sample_tokens = 8
eval_batches = 1
model_overrides = { n_layer = 1, n_head = 2, n_embd = 32, block_size = 64 }
"""


# A whole quick run on the CPU (the first-hour tests): one layer, a short sample, one validation batch, 3 steps.
QUICK_RUN_TOML = """\
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


def command_line(*args: str | Path) -> list[str]:
    """``blutrain ARGS...`` as this environment runs it (what the console script runs)."""
    return [sys.executable, "-m", "blutrain.cli", *map(str, args)]


def blutrain(*args: str | Path, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``blutrain ARGS...`` in ``cwd``, with an empty tiktoken cache under ``cwd``; never raises on failure."""
    cache = cwd / ".tiktoken-cache"
    cache.mkdir(parents=True, exist_ok=True)
    full_env = {**(os.environ if env is None else env), "TIKTOKEN_CACHE_DIR": str(cache)}
    return subprocess.run(command_line(*args), capture_output=True, text=True, cwd=cwd, env=full_env,
                          timeout=timeout)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``proc`` after checking that it succeeded without a traceback."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def one_line_error(proc: subprocess.CompletedProcess[str], command: str, *fragments: str) -> str:
    """The error line of a refused command: exit status 1, no traceback, exactly one line on stderr of the
    form ``blutrain COMMAND: error: ...`` that holds every fragment; returns that line."""
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith(f"blutrain {command}: error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def flags_named(text: str) -> set[str]:
    """Every ``--flag`` a message names."""
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def assert_flags_exist(text: str, command: str, cwd: Path) -> None:
    """Every flag that ``text`` names is one that ``blutrain COMMAND`` accepts (its --help lists it)."""
    usage = ok(blutrain(command, "--help", cwd=cwd)).stdout
    missing = sorted(f for f in flags_named(text) if f not in flags_named(usage))
    assert not missing, f"{text!r} names {missing}, which `blutrain {command}` does not accept"


def write_ranks_file(path: Path, merges: tuple[bytes, ...] = (b"th", b"he", b"the", b" t", b"at")) -> Path:
    """A small GPT-2-style .tiktoken ranks file: the 256 bytes (rank = byte value), then ``merges``."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return path


def write_documents(directory: Path, count: int = 3, words: int = 1500) -> list[Path]:
    """``count`` text files of ``words`` words each, from a fixed seed."""
    import random

    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    vocabulary = ["the", "cat", "sat", "on", "a", "mat", "that", "hat"]
    paths = []
    for i in range(count):
        path = directory / f"doc{i}.txt"
        path.write_text(" ".join(rng.choice(vocabulary) for _ in range(words)) + "\n")
        paths.append(path)
    return paths


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path → sha256 of every file under ``root``: to show that nothing was lost or overwritten."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def quick_workdir(root: Path) -> Path:
    """``root`` made a quick run's directory: quick.toml (QUICK_RUN_TOML) and data/ (byte shards of two stdlib
    files, train and val)."""
    from blutrain.data import get_tokenizer, prepare

    (root / "quick.toml").write_text(QUICK_RUN_TOML)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / "textwrap.py", stdlib / "shlex.py"], root / "data", get_tokenizer("byte"), val_fraction=0.1)
    return root


def small_trained_run(root: Path) -> Path:
    """``root`` made a user's directory with byte-level data (data/) and a two-step run of a small model on it
    (run/), through the CLI as a user runs it."""
    (root / "small.toml").write_text(SMALL_RUN_TOML)
    docs = write_documents(root / "text")
    ok(blutrain("prepare", *docs, "--out", "data", "--tokenizer", "byte", "--val-fraction", "0.1", cwd=root))
    ok(blutrain("train", "--config", "small.toml", "--data", "data", "--max-steps", "2", "--batch-size", "2",
                "--seq-len", "32", "--eval-every", "0", "--out", "run", cwd=root))
    return root
