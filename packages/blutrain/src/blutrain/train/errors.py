"""Errors that stop a training run; configuration and checkpoint errors live beside what they check
(:class:`blutrain.train.ConfigError`, :class:`blutrain.train.CheckpointError`)."""

from __future__ import annotations

from pathlib import Path

from blutrain.tensor.errors import BluTrainError


class TrainError(BluTrainError, RuntimeError):
    """A training run cannot go on; the message says at which step and why."""


class NonFiniteError(TrainError):
    """``--on-nonfinite stop`` met a NaN or infinite loss or gradient norm.

    ``step`` is the step that produced it (1-based, as in metrics.jsonl), ``checkpoint`` the checkpoint
    that holds the last good state (None when there is none)."""

    def __init__(self, message: str, *, step: int, loss: float, grad_norm: float, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.loss = loss
        self.grad_norm = grad_norm
        self.checkpoint = checkpoint


class TrainOutOfMemoryError(TrainError, MemoryError):
    """A training step ran out of device memory; the message holds the allocator's summary and the
    micro-batch that was tried."""

    def __init__(self, message: str, *, step: int, micro_batch: int) -> None:
        super().__init__(message)
        self.step = step
        self.micro_batch = micro_batch


def step_out_of_memory(exc: MemoryError, *, step: int, batch_size: int, seq_len: int,
                       device: str) -> TrainOutOfMemoryError:
    """The error for training step ``step`` running out of memory: the allocator's message ``exc`` (what
    was asked, what is held) between what was tried and what to try."""
    return TrainOutOfMemoryError(
        f"step {step}: out of memory with a micro-batch of {batch_size} × {seq_len} tokens on {device}: {exc}\n"
        "Hint: --auto-batch finds the largest micro-batch that fits and keeps the global batch by gradient "
        "accumulation.", step=step, micro_batch=batch_size)


class TrainInterruptedError(TrainError):
    """SIGINT or SIGTERM stopped the run at a step boundary, after a checkpoint of that step was written.

    ``signal_number`` is the signal, ``step`` the last completed step, ``checkpoint`` the checkpoint that
    resumes it; the ``blutrain`` command exits with 128 + ``signal_number`` (130, 143)."""

    def __init__(self, message: str, *, signal_number: int, step: int, checkpoint: Path) -> None:
        super().__init__(message)
        self.signal_number = signal_number
        self.step = step
        self.checkpoint = checkpoint


__all__ = ["NonFiniteError", "TrainError", "TrainInterruptedError", "TrainOutOfMemoryError", "step_out_of_memory"]
