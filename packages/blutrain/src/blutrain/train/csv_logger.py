"""The ``csv`` logger (``--log csv``): ``OUT/metrics.csv``, one row per step, the columns of metrics.jsonl.

A plugin like any other (entry point ``csv`` of the ``blutrain`` distribution; blockable). A resumed run
keeps the rows up to the step it resumes from and appends after them, as metrics.jsonl does. Every row is
flushed as it is written, so a killed run loses none.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import IO, Any

from blutrain.tensor.plugins import hookimpl
from blutrain.train.loggers import logger_selected

NAME = "csv"
COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tok_per_s", "step_ms", "mfu", "mem_peak_bytes", "skipped")


class CsvLog:
    """``metrics.csv`` of one run; floats are written as Python's repr, so they read back exactly."""

    def __init__(self, path: Path, resumed_step: int | None) -> None:
        self.path = path
        self.resumed_step = resumed_step
        self.file: IO[str] | None = None

    def _open(self) -> Any:
        """At the first row (as metrics.jsonl: a resume that fails earlier changes nothing): the header and
        the kept rows of a resumed run, written anew, then the file open for appending."""
        kept = _rows_up_to(self.path, self.resumed_step) if self.resumed_step is not None else []
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(kept)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 (closed at train_end)
        return csv.writer(self.file)

    def write(self, state: dict[str, Any]) -> None:
        if self.file is None:
            self.writer = self._open()
        assert self.file is not None
        self.writer.writerow(["" if state.get(c) is None else int(state[c]) if isinstance(state[c], bool)
                              else state[c] for c in COLUMNS])
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _rows_up_to(path: Path, step: int) -> list[list[str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or tuple(rows[0]) != COLUMNS:
        return []
    return [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]


_active: CsvLog | None = None


@hookimpl
def blutrain_on_train_event(event: str, state: dict[str, Any]) -> None:
    global _active
    if event == "train_start":
        if _active is not None:
            _active.close()
            _active = None
        if logger_selected(NAME, state):
            config = state["config"]
            _active = CsvLog(Path(config["out"]) / "metrics.csv", state["step"] if config.get("resume") else None)
    elif _active is not None and event == "step_end":
        _active.write(state)
    elif _active is not None and event == "train_end":
        _active.close()
        _active = None
