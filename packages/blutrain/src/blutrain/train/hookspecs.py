"""Hook specification owned by ``blutrain.train``: training events for loggers and profilers."""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("blutrain")


@hookspec
def blutrain_on_train_event(event: str, state: dict[str, Any]) -> None:
    """Called by the trainer at most once per step for each event.

    Events: ``"train_start"``, ``"step_end"`` (state: step, loss, lr, grad_norm, tok_per_s),
    ``"eval_end"`` (step, val_loss), ``"checkpoint_saved"`` (step, path; with ``--async-checkpoint`` sent
    once the state is staged, while the file is still being written), ``"nonfinite"`` (step, loss,
    grad_norm, policy: a NaN or infinite loss or gradient norm, before the policy acts), ``"train_end"`` (step,
    val_loss, checkpoint, train_loss; with ``interrupted``, the signal's name, when SIGINT/SIGTERM stopped the
    run). ``step_end``'s state is the step's metrics.jsonl row (also val_loss, mfu, mem_peak_bytes where
    present). Loggers chosen with ``--log`` read the names from ``state["config"]["log"]`` of ``train_start``.
    ``state`` is a plain dict; implementations must not mutate it. Every implementation is called.
    """
