"""The contract a parallelism mode implements (registered through ``blutrain_register_parallel_modes``).

A mode is a subclass of :class:`ParallelMode` constructed as ``Mode(mesh, *options, **keyword_options)``:
``mesh`` is a :class:`DeviceMesh` that has the mode's dimension (``dim``: "dp", "tp", "cp", ...) or a process
group itself. It wraps the model (and, where it shards optimizer state, the optimizer); modes compose by
wrapping in turn on one mesh, innermost first.

Everything the trainer needs from a mode is declared here, each with the default that fits a mode which does
not have the capability: class flags say what the mode changes (the loss, the layers, where gradients and
state live), and the methods behind a flag raise :class:`NotImplementedError` until a mode that sets the flag
fills them in. The trainer reads these and nothing else; it names no mode.

A mode that composes with ``blutrain.compiler`` sets ``compiles = True``: it makes every collective of a
training step through groups declared with :func:`blutrain.dist.traceable` (and keeps the promises that
declaration makes), so they are recorded into a compiled step. ``blutrain train --compile --parallel ...``
refuses a mode without it; a collective of an undeclared group inside a compiled function is refused while
it is traced, naming the line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from blutrain.tensor import Tensor

from blutrain.dist.mesh import DeviceMesh
from blutrain.dist.process_group import ProcessGroup
from blutrain.dist.placement import Placement
from blutrain.dist.sharded import StateShard


class ParallelMode:
    """Base class of every parallelism mode: the declared capabilities and their defaults.

    Class attributes a mode sets:

    - ``dim``: the mesh dimension the mode works along.
    - ``compiles``: composes with ``blutrain.compiler`` (see the module doc).
    - ``on_mesh``: the mesh form of ``--parallel`` (``dp=2,tp=2``) applies this mode along ``dim``; at most one
      installed mode per dimension says so. ``mesh_order``: where ``dim`` sits in a mesh, outermost (smallest)
      first: data parallelism outermost, the dimension whose ranks talk most innermost (neighbours on a node).
      ``mesh_options``: the mesh form's keys that configure this mode → the keyword argument each sets
      (``attn`` → ``attn``).
    - ``on_mesh_by_name``: the mesh form runs this mode along ``dim`` in place of the dimension's ``on_mesh`` mode
      when it names the mode, ``NAME[=VALUE]`` beside the sizes with VALUE its first option
      (``dp=2,tp=2,zero=1``: ZeRO stage 1 along dp instead of DDP); the mesh must give ``dim`` a size, and at
      most one mode per dimension may be named so.
    - ``splits_batch``: ranks along ``dim`` train on different rows of the batch (data parallelism); the
      trainer's data rank and size are taken over the mesh dimensions whose modes declare it (ranks that
      differ only along the others, tp or cp, read the same rows).
    - ``shards_loss``: the wrapped model's forward computes the loss itself, from logits sharded over the
      ranks; it takes no ``return_logits`` option.
    - ``rewrites_layers``: ``wrap_model`` rewrote the model's layers for sharded inputs, so the model alone no
      longer runs a whole sequence: generation runs a fresh copy loaded with whole state.
    - ``wraps_rewritten``: a layer-rewriting mode whose ``wrap_model`` also takes the model an inner mode of the
      mesh rewrote (a ``blutrain.models.RewrittenModel``: context parallelism over tensor parallelism); two
      rewriting modes compose on a mesh only when the outer one declares it.
    - ``shards_gradients``: no rank holds every whole gradient; :meth:`grad_norm` and :meth:`clip_grad_norm_`
      give the global norm.
    - ``shards_state``: ranks hold parts of the model or optimizer state; checkpoints are written by
      :meth:`state_shard`, whole state is read by :meth:`full_state_dict` and loaded by :meth:`load_full_state`.
      On a mesh, :meth:`placements` says where each of a rank's tensors sits in the single-process state, for an
      outer mode that shards them further (``nests_state``); :attr:`state_dims` names the mesh dimensions along
      which ranks hold different parts (one checkpoint file per rank of :attr:`group`, written by the ranks whose
      index along every other dimension is 0).
    - ``nests_state``: a ``shards_state`` mode that, on a mesh, shards what each rank holds once the inner modes
      have wrapped the model (ZeRO over tensor parallelism's blocks). Before :meth:`wrap_model` the trainer calls
      :meth:`nest` with the single-process model as the inner modes left it and the outermost inner mode that
      shards state (or None); the mode then names, saves, loads and counts state in the single-process
      model's terms, through that mode's :meth:`placements`.
    """

    dim: ClassVar[str]
    compiles: ClassVar[bool] = False
    on_mesh: ClassVar[bool] = False
    mesh_order: ClassVar[int] = 0
    mesh_options: ClassVar[Mapping[str, str]] = {}
    splits_batch: ClassVar[bool] = False
    shards_loss: ClassVar[bool] = False
    rewrites_layers: ClassVar[bool] = False
    wraps_rewritten: ClassVar[bool] = False
    shards_gradients: ClassVar[bool] = False
    shards_state: ClassVar[bool] = False
    on_mesh_by_name: ClassVar[bool] = False
    nests_state: ClassVar[bool] = False

    group: ProcessGroup  # the group along ``dim`` (sharded checkpoints have one file per rank of it)

    @property
    def state_dims(self) -> tuple[str, ...]:
        """The mesh dimensions along which the ranks of :attr:`group` hold different parts of the state (a
        ``shards_state`` mode's checkpoint files): ``dim`` unless the mode says otherwise."""
        return (self.dim,)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, *options: Any, **keyword_options: Any) -> None:
        """A mode is made over a mesh (its group along ``dim``), a process group, or None (the default group), with
        the options ``--parallel`` gives; it sets :attr:`group`."""
        raise NotImplementedError(f"{type(self).__name__} does not define __init__(mesh, ...), which sets group")

    @classmethod
    def check_options(cls, *options: Any, **keyword_options: Any) -> None:
        """Raise :class:`blutrain.dist.DistArgumentError` for options the mode cannot take (as the constructor
        would), before any process group exists: ``blutrain train`` checks ``--parallel`` so before a rank
        starts work. The default accepts everything and leaves the checks to the constructor."""

    @classmethod
    def sequence_multiple(cls, size: int) -> int:
        """What the sequence length must be a multiple of when ``size`` ranks run the mode (1: anything)."""
        return 1

    def wrap_model(self, model: Any) -> Any:
        """The model to train in place of ``model`` (may be the same object, rewritten)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement wrap_model")

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """The optimizer to step in place of ``optimizer`` (``optimizer`` itself where nothing is sharded)."""
        return optimizer

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally, with no communication (gradient accumulation:
        the trainer enters it for every micro-batch but the last)."""
        return contextlib.nullcontext()

    def gathered(self) -> AbstractContextManager[None]:
        """Inside, every parameter of the unwrapped model is whole on every rank (a collective on entry), for
        code that calls the model's parts directly, such as generation."""
        return contextlib.nullcontext()

    # -- shards_gradients ------------------------------------------------------------------------
    def grad_norm(self) -> Tensor:
        """The L2 norm of the whole model's gradient, the same on every rank (a collective)."""
        raise NotImplementedError(_undeclared(self, "shards_gradients", "grad_norm"))

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """As :func:`blutrain.optim.clip_grad_norm_` over the whole model: scale every gradient by
        ``min(1, max_norm / norm)`` with the global norm; returns the norm before clipping (a collective)."""
        raise NotImplementedError(_undeclared(self, "shards_gradients", "clip_grad_norm_"))

    # -- shards_state ----------------------------------------------------------------------------
    def placements(self) -> list[Placement]:
        """Where each tensor of this rank's model state (parameters and persistent buffers, the model's own
        tensors) sits in the single-process model's state, in ``state_dict`` order (no collective)."""
        raise NotImplementedError(_undeclared(self, "shards_state", "placements"))

    def state_shard(self, optimizer: Any) -> StateShard:
        """This rank's part of a checkpoint of the model and ``optimizer`` (the optimizer to step), with no
        collective; the shards of every rank of :attr:`group` merge into whole state
        (:func:`blutrain.dist.merge_shards`)."""
        raise NotImplementedError(_undeclared(self, "shards_state", "state_shard"))

    def full_state_dict(self) -> dict[str, Tensor]:
        """The single-process model's ``state_dict()`` (a collective over the mode's ranks)."""
        raise NotImplementedError(_undeclared(self, "shards_state", "full_state_dict"))

    def load_full_state(self, model_state: dict[str, Tensor], optimizer: Any, optimizer_state: dict[str, Any]) -> None:
        """Load whole state (a single-process checkpoint, or merged shards) into this rank's parts of the model
        and of ``optimizer``. No collective."""
        raise NotImplementedError(_undeclared(self, "shards_state", "load_full_state"))


    # -- nests_state -----------------------------------------------------------------------------
    def nest(self, net: Any, inner: ParallelMode | None) -> None:
        """On a mesh, before :meth:`wrap_model`: ``net`` is the single-process model as the inner modes left it
        (rewritten in place: its tensors are this rank's), ``inner`` the outermost inner mode that shards state
        (its :meth:`placements` place ``net``'s tensors; None: every tensor is whole)."""
        raise NotImplementedError(_undeclared(self, "nests_state", "nest"))


def _undeclared(mode: ParallelMode, flag: str, method: str) -> str:
    return f"{type(mode).__name__}.{method} is not implemented: a mode that sets {flag} = True implements it"


__all__ = ["ParallelMode"]
