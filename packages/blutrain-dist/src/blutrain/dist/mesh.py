"""A device mesh: the ranks of a group laid out on named dimensions (dp, tp, cp), with one
sub-group per dimension.

Ranks are laid out row-major, the last dimension fastest: with ``{"dp": 2, "tp": 2}`` ranks 0 and 1
form a tp group (neighbours, as Megatron places tensor parallelism within a node) and ranks 0 and
2 a dp group. Each rank belongs to exactly one group per dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from blutrain.dist.errors import DistArgumentError
from blutrain.dist.process_group import ProcessGroup


def coordinates(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh coordinates of ``rank`` (row-major)."""
    out = []
    for n in reversed(shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def rank_of(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    rank = 0
    for c, n in zip(coords, shape, strict=True):
        rank = rank * n + c
    return rank


class DeviceMesh:
    """``DeviceMesh(group, {"dp": 2, "tp": 2})``: the sizes must multiply to ``group.size``.

    Creating it is collective over ``group`` (every rank creates the same mesh, in the same order
    relative to other collectives): it splits one sub-group per dimension.
    """

    def __init__(self, group: ProcessGroup, dims: Mapping[str, int]) -> None:
        if not isinstance(dims, Mapping) or not dims:
            raise DistArgumentError(f"DeviceMesh: dims must be a non-empty mapping name → size, got {dims!r}")
        for name, n in dims.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise DistArgumentError(f"DeviceMesh: dimension names must be identifiers, got {name!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise DistArgumentError(f"DeviceMesh: size of dimension {name!r} must be an int >= 1, got {n!r}")
        if math.prod(dims.values()) != group.size:
            raise DistArgumentError(f"DeviceMesh: dimension sizes {dict(dims)} multiply to "
                                    f"{math.prod(dims.values())}, but the group has {group.size} ranks")
        self.group = group
        self.names: tuple[str, ...] = tuple(dims)
        self.shape: tuple[int, ...] = tuple(dims.values())
        self.coords: tuple[int, ...] = coordinates(group.rank, self.shape)
        self._groups: dict[str, ProcessGroup] = {}
        for i, name in enumerate(self.names):
            others = self.coords[:i] + self.coords[i + 1:]
            color = rank_of(others, self.shape[:i] + self.shape[i + 1:])
            self._groups[name] = group.split(color, self.coords[i])

    def _index(self, dim: str) -> int:
        if dim not in self.names:
            raise DistArgumentError(f"DeviceMesh: no dimension {dim!r}; the mesh has {', '.join(self.names)}")
        return self.names.index(dim)

    def get_group(self, *dims: str) -> ProcessGroup:
        """The group of the ranks that differ from this one only along ``dims`` (one or more).

        Several dimensions (``get_group("dp", "cp")``: the replicas of a model that context
        parallelism also replicates) give a group split on first use and kept, ordered row-major over
        those dimensions: that first call is collective over the mesh's group.
        """
        if not dims:
            raise DistArgumentError(f"DeviceMesh.get_group: name at least one dimension of {', '.join(self.names)}")
        idx = sorted({self._index(d) for d in dims})
        if len(idx) == 1:
            return self._groups[self.names[idx[0]]]
        key = tuple(self.names[i] for i in idx)
        group = self._groups.get(",".join(key))
        if group is None:
            fixed = [i for i in range(len(self.shape)) if i not in idx]
            color = rank_of(tuple(self.coords[i] for i in fixed), tuple(self.shape[i] for i in fixed))
            order = rank_of(tuple(self.coords[i] for i in idx), tuple(self.shape[i] for i in idx))
            group = self._groups[",".join(key)] = self.group.split(color, order)
        return group

    def size(self, dim: str) -> int:
        return self.shape[self._index(dim)]

    def local_rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (its rank in ``get_group(dim)``)."""
        return self.coords[self._index(dim)]

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this rank's group along ``dim``, in group-rank order."""
        i = self._index(dim)
        return [rank_of(self.coords[:i] + (c,) + self.coords[i + 1:], self.shape) for c in range(self.shape[i])]

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))
        return f"DeviceMesh({dims}; rank {self.group.rank} at {dict(zip(self.names, self.coords, strict=True))})"


__all__ = ["DeviceMesh", "coordinates", "rank_of"]
