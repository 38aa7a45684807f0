"""A model family's parallel plan: which of its layers tensor and context parallelism cut, and how.

A plan names layers by their paths in the module tree, as torchtitan's per-model ``parallelize``
functions do, so the parallelism modes (``blutrain-parallel-tp``, ``blutrain-parallel-cp``) know no
particular model: they apply the plan of whatever model they wrap.

- ``column``: Linears of every block whose output features are split over the tensor-parallel ranks,
  each with its number of equal parts split separately (a fused q/k/v projection: 3, so every rank
  keeps whole heads of each).
- ``row``: Linears of every block whose input features are split (their output summed over ranks).
- ``attention``: the block's attention module; tensor parallelism divides each of its
  ``head_attributes`` (e.g. ``n_head``, ``n_kv_head``) by the group size, and context parallelism sets
  its ``attention_core`` (:class:`PlannedAttention`).
- ``vocab_embedding``: the token embedding, vocab-parallel under tensor parallelism; ``head``: the LM
  head, vocab-parallel too (tied to the embedding when it holds the embedding's weight).

Paths are dotted attribute names (``transformer.h``, ``attn.c_attn``); paths of ``column``, ``row``
and ``attention`` are relative to each block of ``blocks``, the others to the model.

Modes compose on a mesh: a mode that rewrites layers (tensor parallelism) returns a
:class:`RewrittenModel`, and a mode that declares ``ParallelMode.wraps_rewritten`` (context parallelism) wraps
that as it wraps a model: it reaches the model's layers through :func:`unwrapped` and the plan, and computes
the logits and the loss through :func:`head_logits` and :func:`token_loss_sum`, which the rewritten model
serves its own way (a vocabulary shard and a vocab-parallel loss).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from blutrain.dist import DistArgumentError
from blutrain.models.errors import ModelError
from blutrain.nn import AttentionCore, Module
from blutrain.tensor import Tensor, cross_entropy


class PlannedAttention(Protocol):
    """An attention module named by a plan: ``attention_core`` None computes plain causal attention on
    the module's own kernels; a callable replaces that step (context parallelism sets one that attends
    across the ranks' shards of the sequence), everything around it (projections, rotary embeddings,
    head split and merge) unchanged."""

    attention_core: AttentionCore | None


@dataclass(frozen=True)
class ModelParallelPlan:
    """Which layers of a model are column/row parallel, vocab parallel, and which attention takes context
    parallelism (see the module's doc)."""

    blocks: str
    attention: str
    head_attributes: tuple[str, ...]
    column: Mapping[str, int]
    row: tuple[str, ...]
    vocab_embedding: str
    head: str

    def block_modules(self, model: Module) -> Iterator[tuple[str, Module]]:
        """Every block as (its path, the module); of a rewritten model, its model's."""
        blocks = module_at(unwrapped(model), self.blocks)
        for name, block in blocks.named_children():
            yield f"{self.blocks}.{name}", block

    def attentions(self, model: Module) -> Iterator[tuple[str, Any]]:
        """Every block's attention module as (its path, the module)."""
        for prefix, block in self.block_modules(model):
            yield f"{prefix}.{self.attention}", module_at(block, self.attention)


class RewrittenModel(Module):
    """A model that a parallelism mode rewrote (``module``, rewritten in place, with its ``plan``), as the next
    mode of a mesh sees it: the model's ``check_ids`` and ``hidden_states``, and the head and loss as the
    rewriting computes them. A subclass implements :meth:`logits` (the head applied to hidden states, e.g.
    this rank's vocabulary shard) and :meth:`loss_sum`."""

    module: Any  # a blutrain.models.Model
    plan: ModelParallelPlan

    def check_ids(self, idx: Tensor, argument: str = "idx", check_length: bool = True) -> None:
        self.module.check_ids(idx, argument, check_length)

    def hidden_states(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        out: Tensor = self.module.hidden_states(idx, positions)
        return out

    def logits(self, x: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__}.logits")

    def loss_sum(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The cross-entropy summed over the rows of ``logits`` (N, classes as :meth:`logits` gives them) whose
        ``targets`` (N,) are not -1, and how many those are, both device values."""
        raise NotImplementedError(f"{type(self).__name__}.loss_sum")


def unwrapped(model: Module) -> Module:
    """The model whose layers the plan's paths name: a rewritten model's ``module``, else ``model``."""
    if isinstance(model, RewrittenModel):
        inner: Module = model.module
        return inner
    return model


def head_logits(model: Module, x: Tensor) -> Tensor:
    """The LM head (the plan's ``head``) applied to hidden states ``x``, as a rewritten model computes it."""
    if isinstance(model, RewrittenModel):
        return model.logits(x)
    out: Tensor = module_at(model, require_plan("head_logits", model).head)(x)
    return out


def token_loss_sum(model: Module, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The cross-entropy of ``logits`` (N, classes) summed over the ``targets`` (N,) that are not -1, and their
    count (device values), as ``model`` (a rewritten model: its own loss) computes them."""
    if isinstance(model, RewrittenModel):
        return model.loss_sum(logits, targets)
    return cross_entropy(logits, targets, ignore_index=-1, reduction="sum"), (targets != -1).sum()


def plan_of(model: object) -> ModelParallelPlan | None:
    """The parallel plan ``model``'s class declares (:class:`blutrain.models.Model`), a rewritten model's plan, or
    None: no plan, or not a model. What a parallelism mode calls on the model it is given, to refuse anything
    else by name."""
    if isinstance(model, RewrittenModel):
        return model.plan
    plan = getattr(type(model), "parallel_plan", None) if isinstance(model, Module) else None
    return plan if isinstance(plan, ModelParallelPlan) else None


def require_plan(where: str, model: object) -> ModelParallelPlan:
    """The parallel plan ``model`` declares, for a parallelism mode (``where`` names it in the message) that applies
    it; anything without one is the mode's argument error (:class:`blutrain.dist.DistArgumentError`)."""
    plan = plan_of(model)
    if plan is None:
        raise DistArgumentError(f"{where}: model must be a blutrain.models.Model with a parallel_plan (a "
                                f"ModelParallelPlan), got {type(model).__name__}; register the family with one")
    return plan


def module_at(root: Module, path: str) -> Any:
    """The module at dotted ``path`` under ``root``; a missing name is a ModelError naming the path."""
    out: Any = root
    for part in path.split("."):
        child = dict(out.named_children()).get(part) if isinstance(out, Module) else None
        if child is None:
            raise ModelError(f"parallel plan: {type(root).__name__} has no module at {path!r} (no {part!r} in "
                             f"{type(out).__name__})")
        out = child
    return out


def replace_module(root: Module, path: str, new: Module) -> None:
    """Put ``new`` at dotted ``path`` under ``root`` (the module there must exist)."""
    parent_path, _, name = path.rpartition(".")
    module_at(root, path)
    parent = module_at(root, parent_path) if parent_path else root
    parent.add_module(name, new)


__all__ = ["AttentionCore", "ModelParallelPlan", "PlannedAttention", "RewrittenModel", "head_logits", "module_at",
           "plan_of", "replace_module", "token_loss_sum", "unwrapped"]
