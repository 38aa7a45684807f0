"""The contract a parallelism mode implements (registered through ``blutrain_register_parallel_modes``).

A mode is a class constructed as ``Mode(mesh, **options)``: ``mesh`` is a :class:`DeviceMesh` that
has the mode's dimension (``dim``: "dp" for ddp/zero, "tp", "cp"). It wraps the model (and, where
it shards optimizer state, the optimizer); modes compose by wrapping in turn on one mesh.

A mode that composes with ``blutrain.compiler`` says so with a class attribute ``compiles = True``: it
makes every collective of a training step through groups declared with :func:`blutrain.dist.traceable`
(and keeps the promises that declaration makes), so they are recorded into a compiled step. ``blutrain train
--compile --parallel ...`` refuses a mode without it; a collective of an undeclared group inside a
compiled function is refused while it is traced, naming the line.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ParallelMode(Protocol):
    dim: str

    def wrap_model(self, model: Any) -> Any:
        """The model to train in place of ``model`` (may be the same object, rewritten)."""

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """The optimizer to step in place of ``optimizer`` (``optimizer`` itself where nothing is sharded)."""


__all__ = ["ParallelMode"]
