"""Generic gather/scatter kernels, concatenation, triangular masks and embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np

from blutrain.tensor.backend import array_module

Array = Any


def index(a: Array, key: tuple[Any, ...]) -> Array:
    out = a[key]
    return out.copy() if out.base is not None and out.base is a else out


def index_put(a: Array, key: tuple[Any, ...], value: Any, accumulate: bool) -> None:
    if accumulate:
        array_module(a).add.at(a, key, value)
    else:
        a[key] = value


def index_select(a: Array, dim: int, idx: Array) -> Array:
    return array_module(a).take(a, idx, axis=dim)


def gather(a: Array, dim: int, idx: Array) -> Array:
    xp = array_module(a)
    if idx.shape != a.shape:
        a = a[tuple(slice(0, s) if i != dim else slice(None) for i, s in enumerate(idx.shape))]
    return xp.take_along_axis(a, idx, axis=dim)


def _scatter_index(xp: Any, idx: Array, dim: int) -> tuple[Array, ...]:
    grids = list(xp.indices(idx.shape, sparse=True))
    grids[dim] = idx
    return tuple(grids)


def scatter_add(a: Array, dim: int, idx: Array, src: Array) -> Array:
    xp = array_module(a)
    out = a.copy()
    xp.add.at(out, _scatter_index(xp, idx, dim), src)
    return out


def index_add(a: Array, dim: int, idx: Array, src: Array) -> Array:
    xp = array_module(a)
    out = a.copy()
    xp.add.at(out, (slice(None),) * dim + (idx,), src)
    return out


def tril(a: Array, k: int) -> Array:
    return array_module(a).tril(a, k)


def triu(a: Array, k: int) -> Array:
    return array_module(a).triu(a, k)


def cat(arrays: list[Array], dim: int) -> Array:
    return array_module(arrays[0]).concatenate(arrays, axis=dim)


def embedding(weight: Array, idx: Array) -> Array:
    return array_module(weight).take(weight, idx, axis=0)


def embedding_backward(grad: Array, idx: Array, num_embeddings: int) -> Array:
    """Sum gradient rows per token id. Sorting first makes the sum order fixed (deterministic) and
    turns it into one segmented reduction instead of a scatter with collisions."""
    xp = array_module(grad)
    dim = grad.shape[-1]
    flat_idx = idx.reshape(-1)
    rows = grad.reshape(flat_idx.size, dim)  # explicit sizes: -1 cannot be inferred when dim is 0
    out = xp.zeros((num_embeddings, dim), dtype=grad.dtype)
    if flat_idx.size == 0:
        return out
    if xp is np:
        order = np.argsort(flat_idx, kind="stable")
        sorted_idx = flat_idx[order]
        uniq, starts = np.unique(sorted_idx, return_index=True)
        out[uniq] = np.add.reduceat(rows[order], starts, axis=0)
    else:  # pragma: no cover - device backends bring their own kernel
        xp.add.at(out, flat_idx, rows)
    return out
