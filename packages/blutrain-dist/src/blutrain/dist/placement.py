"""Placement: where one rank's tensor of a model's state sits in the single-process model's state.

A mode that shards the state (tensor parallelism) says, for each tensor of a rank's model, the name the
single-process model gives it, the whole tensor's shape, and which of the whole tensor's elements the rank's
tensor holds (a :data:`blutrain.dist.Range`, in the order of the rank's tensor flattened). A mode of the mesh
that shards further what each rank holds (ZeRO over tensor parallelism) names, saves, loads and counts state
through these: its shard of a rank's tensor is a window of that range (:class:`blutrain.dist.StateShard`'s
``windows``).

``saved`` is False where another rank of the placing mode's group holds the same elements (a tensor that
tensor parallelism replicates, on every tp rank but the first): such a tensor is saved and counted in a norm
once, by the rank that has ``saved``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from blutrain.tensor import Tensor, cat

from blutrain.dist.errors import DistArgumentError
from blutrain.dist.sharded import Range, range_blocks


@dataclass(frozen=True)
class Placement:
    """``tensor`` (this rank's, the model's own parameter or buffer) is the elements ``range`` of the
    single-process model's tensor ``name`` of shape ``shape``; ``saved``: this rank saves and counts it."""

    tensor: Tensor
    name: str
    shape: tuple[int, ...]
    range: Range
    saved: bool = True

    @property
    def whole(self) -> bool:
        """The rank's tensor is the whole tensor."""
        return tuple(self.range) == (0, math.prod(self.shape))


def whole_placements(state: Mapping[str, Tensor]) -> list[Placement]:
    """Every tensor of ``state`` (a model's ``state_dict(keep_vars=True)``: name → its own tensor) whole, under
    its own name: the placements of a model no mode has cut."""
    return [Placement(t, name, tuple(t.shape), (0, t.numel())) for name, t in state.items()]


def take_range(full: Tensor, r: Range, where: str = "take_range") -> Tensor:
    """The elements range ``r`` names of ``full`` flattened, as a 1-D tensor in the range's order (a rank's
    tensor of a placement, flattened, from the single-process tensor)."""
    n = full.numel()
    blocks = range_blocks(r)
    if max(stop for _, stop in blocks) > n:
        raise DistArgumentError(f"{where}: range {list(r)} is not inside the {n} elements of a tensor of shape "
                                f"{list(full.shape)}")
    flat = full.detach().reshape(-1)
    if len(blocks) == 1:
        return flat[blocks[0][0]:blocks[0][1]]
    return cat([flat[a:b] for a, b in blocks])


__all__ = ["Placement", "take_range", "whole_placements"]
