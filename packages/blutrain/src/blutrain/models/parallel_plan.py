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
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from blutrain.dist import DistArgumentError
from blutrain.models.errors import ModelError
from blutrain.nn import AttentionCore, Module


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
        """Every block as (its path, the module)."""
        blocks = module_at(model, self.blocks)
        for name, block in blocks.named_children():
            yield f"{self.blocks}.{name}", block

    def attentions(self, model: Module) -> Iterator[tuple[str, Any]]:
        """Every block's attention module as (its path, the module)."""
        for prefix, block in self.block_modules(model):
            yield f"{prefix}.{self.attention}", module_at(block, self.attention)


def plan_of(model: object) -> ModelParallelPlan | None:
    """The parallel plan ``model``'s class declares (:class:`blutrain.models.Model`), or None: no plan, or not a
    model. What a parallelism mode calls on the model it is given, to refuse anything else by name."""
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


__all__ = ["AttentionCore", "ModelParallelPlan", "PlannedAttention", "module_at", "plan_of", "replace_module"]
