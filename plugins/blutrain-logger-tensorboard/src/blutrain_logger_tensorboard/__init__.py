"""blutrain-logger-tensorboard: TensorBoard event files of a training run (``blutrain train --log tensorboard``).

A logger plugin: it implements ``blutrain_on_train_event`` and writes only in runs whose ``--log`` names
``tensorboard``, into ``OUT/tensorboard/`` (``tensorboard --logdir OUT`` shows it). tensorboardX writes the
event files, so neither torch nor tensorflow is needed; it is imported when a run selects this logger.
"""

import os
from pathlib import Path

from blutrain_logger_tensorboard.writer import NAME, TAGS, EventLog, blutrain_on_train_event


def read_scalars(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``logdir`` (a run's ``OUT/tensorboard``): tag → [(step, value)]."""
    from blutrain_logger_tensorboard.reader import read_scalars as read

    return read(Path(logdir))


__all__ = ["NAME", "TAGS", "EventLog", "blutrain_on_train_event", "read_scalars"]
