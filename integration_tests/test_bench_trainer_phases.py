"""tools/bench/trainer_phases.py on the CPU: the tiny preset compiled, every phase of the trainer's step timed
over the steps after --skip, and the JSON it writes (no time is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench import trainer_phases


def test_every_phase_of_a_compiled_cpu_run_is_timed_and_written(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "phases.json"
    assert trainer_phases.main(["--device", "cpu", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32",
                                "--steps", "6", "--skip", "2", "--compile", "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["phases"]
    for phase in ("launch", "next batch", "bookkeeping", "read", "step", "between"):
        assert phase in phases and phases[phase]["n"] >= 1 and phases[phase]["median_ms"] >= 0, phase
    assert phases["step"]["n"] == 4  # steps 3-6
    assert "phase" in capsys.readouterr().out


def test_fewer_steps_than_skipped_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        trainer_phases.main(["--device", "cpu", "--steps", "3", "--skip", "5"])
    assert "--steps must be above --skip (5), got 3" in capsys.readouterr().err
