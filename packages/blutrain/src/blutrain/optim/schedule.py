"""Learning-rate schedules: plain functions of the step, so a checkpoint needs only the step to resume.

``step`` counts optimizer steps from 0. The trainer sets ``group["lr"] = schedule(step, ...)`` for
every parameter group before each step.
"""

from __future__ import annotations

import math

from blutrain.optim.errors import OptimizerError


def _check(name: str, value: object, minimum: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise OptimizerError(f"{name} must be a finite number >= {minimum}, got {value!r}")


def warmup_cosine(step: int, max_lr: float, warmup_steps: int, total_steps: int,
                  min_lr: float = 0.0) -> float:
    """Linear warm-up to ``max_lr``, then cosine decay to ``min_lr`` at ``total_steps``, then ``min_lr``.

    Warm-up gives ``max_lr · (step + 1) / warmup_steps`` for ``step < warmup_steps`` (so the first
    step already moves, as llm.c does); from ``warmup_steps`` to ``total_steps`` the rate follows
    ``min_lr + ½(1 + cos(π·progress))·(max_lr − min_lr)``.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise OptimizerError(f"warmup_cosine: step must be an int >= 0, got {step!r}")
    for name, value in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OptimizerError(f"warmup_cosine: {name} must be an int >= 0, got {value!r}")
    _check("warmup_cosine: max_lr", max_lr)
    _check("warmup_cosine: min_lr", min_lr)
    if min_lr > max_lr:
        raise OptimizerError(f"warmup_cosine: min_lr ({min_lr}) must not exceed max_lr ({max_lr})")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def constant(step: int, lr: float, warmup_steps: int = 0) -> float:
    """``lr`` at every step, after an optional linear warm-up of ``warmup_steps``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise OptimizerError(f"constant: step must be an int >= 0, got {step!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise OptimizerError(f"constant: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    _check("constant: lr", lr)
    return lr * (step + 1) / warmup_steps if step < warmup_steps else lr


__all__ = ["constant", "warmup_cosine"]
