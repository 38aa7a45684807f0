"""The ``tensorboard`` logger: one scalar per metric and step in ``OUT/tensorboard/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blutrain.tensor.plugins import hookimpl
from blutrain.train import logger_selected

NAME = "tensorboard"
# metrics.jsonl key → TensorBoard tag
TAGS: dict[str, str] = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                        "tok_per_s": "perf/tok_per_s", "step_ms": "perf/step_ms", "mfu": "perf/mfu",
                        "mem_peak_bytes": "perf/mem_peak_bytes"}


class EventLog:
    """The event file of one run. A resumed run purges the events after the step it resumes from (they
    are trained again), as metrics.jsonl drops their rows."""

    def __init__(self, logdir: Path, resumed_step: int | None) -> None:
        from tensorboardX import SummaryWriter

        purge = resumed_step + 1 if resumed_step is not None else None
        self.writer = SummaryWriter(logdir=str(logdir), purge_step=purge, flush_secs=10)

    def write(self, state: dict[str, Any]) -> None:
        step = int(state["step"])
        for key, tag in TAGS.items():
            value = state.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


_active: EventLog | None = None
_pending: tuple[Path, int | None] | None = None  # the run's logdir and resumed step, until its first step ends


@hookimpl
def blutrain_on_train_event(event: str, state: dict[str, Any]) -> None:
    global _active, _pending
    if event == "train_start":
        if _active is not None:
            _active.close()
        _active = _pending = None
        if logger_selected(NAME, state):
            config = state["config"]
            _pending = (Path(config["out"]) / "tensorboard", state["step"] if config.get("resume") else None)
    elif event == "step_end" and _pending is not None:
        # opened at the first step, as metrics.jsonl is written: a resume that fails earlier purges nothing
        _active = EventLog(*_pending)
        _pending = None
        _active.write(state)
    elif _active is None:
        return
    elif event == "step_end":
        _active.write(state)
    elif event == "checkpoint_saved":
        _active.flush()  # what a checkpoint holds is on disk in the events too
    elif event == "train_end":
        _active.close()
        _active = None
