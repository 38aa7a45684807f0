"""blutrain.train: the trainer, its config, checkpoints and the training-event hook spec.

The trainer pulls in the model, data and optimizer packages; it is imported on first use so that
loading this package's hook specifications (which every plugin load does) stays cheap.
"""

from typing import Any

from blutrain.train.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    load_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
    stage_checkpoint,
    write_checkpoint,
)
from blutrain.train.config import ConfigError, ParallelPlan, TrainConfig
from blutrain.train.errors import NonFiniteError, TrainError, TrainInterruptedError, TrainOutOfMemoryError
from blutrain.train.loggers import logger_selected

__all__ = ["CheckpointError", "CheckpointWriter", "ConfigError", "NonFiniteError", "ParallelPlan", "TrainConfig",
           "TrainError", "TrainInterruptedError", "TrainOutOfMemoryError", "Trainer", "load_checkpoint",
           "logger_selected", "rotate_checkpoints", "save_checkpoint", "stage_checkpoint", "write_checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from blutrain.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'blutrain.train' has no attribute {name!r}")
