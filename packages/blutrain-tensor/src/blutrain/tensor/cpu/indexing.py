"""Generic gather/scatter kernels, concatenation, triangular masks and embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np

from blutrain.tensor.backend import array_module
from blutrain.tensor.dtype import HALF_NAMES
from blutrain.tensor.errors import ShapeError, TensorTypeError, TensorValueError

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


def embedding_backward(grad: Array, idx: Array, num_embeddings: int, addend: Array | None = None,
                       addend_scale: Array | None = None) -> Array:
    """Sum gradient rows per token id. Sorting first makes the sum order fixed (deterministic) and
    turns it into one segmented reduction instead of a scatter with collisions.

    With ``addend`` ([num_embeddings, D], grad's dtype) the result is ``addend * addend_scale + sums`` (or
    ``addend + sums`` without the 0-d ``addend_scale``): a tied weight's other gradient (the LM head's,
    times the loss scale), which the compiler's ``embedding-grad-add`` pass folds in here instead of a
    multiply and an add over the whole weight. Each step rounds as the separate ops round it: the
    product, the sums and the final add each to grad's dtype (float16/bfloat16 computed in float32 and
    rounded, as the generic kernels do), with the product as the add's first operand, as autograd adds
    the head's gradient and then the embedding's. Rows no id selects are ``product + 0`` (so a -0.0
    product gives +0.0, as the separate add of the zero row does).
    """
    xp = array_module(grad)
    check_embedding_addend(grad, num_embeddings, addend, addend_scale)
    half = grad.dtype.name in HALF_NAMES
    out = _row_sums(xp, grad.astype(np.float32) if half else grad, idx, num_embeddings)
    if half:
        out = out.astype(grad.dtype)
    if addend is None:
        return out
    return _scaled_sum(addend, addend_scale, out)



def check_embedding_addend(grad: Array, num_embeddings: int, addend: Array | None, addend_scale: Array | None) -> None:
    """The addend's contract, checked before any compute: a user who calls the kernel directly learns which
    argument is wrong instead of getting a broadcast result of another shape or dtype."""
    if addend is None:
        if addend_scale is not None:
            raise TensorValueError("embedding_backward: addend_scale needs an addend; got addend=None")
        return
    want = (int(num_embeddings), int(grad.shape[-1]) if grad.ndim else 0)
    if tuple(addend.shape) != want:
        raise ShapeError(f"embedding_backward: addend must have the weight's shape {want}, got {tuple(addend.shape)}")
    if addend.dtype != grad.dtype:
        raise TensorTypeError(f"embedding_backward: addend must have grad's dtype {grad.dtype.name}, got "
                              f"{addend.dtype.name}")
    if addend_scale is not None and (getattr(addend_scale, "shape", None) != ()
                                     or getattr(addend_scale, "dtype", None) != grad.dtype):
        got = (f"{addend_scale.dtype.name} of shape {tuple(addend_scale.shape)}" if hasattr(addend_scale, "dtype")
               else type(addend_scale).__name__)
        raise TensorTypeError(f"embedding_backward: addend_scale must be a 0-d {grad.dtype.name} array, got {got}")


def _row_sums(xp: Any, grad: Array, idx: Array, num_embeddings: int) -> Array:
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


def _scaled_sum(addend: Array, addend_scale: Array | None, sums: Array) -> Array:
    """``addend * addend_scale + sums`` with the roundings of the separate multiply and add (each in float32
    and rounded back for the half dtypes)."""
    dtype = sums.dtype
    wide = np.float32 if dtype.name in HALF_NAMES else dtype
    term = addend
    if addend_scale is not None:
        term = (addend.astype(wide, copy=False) * addend_scale.astype(wide, copy=False)).astype(dtype, copy=False)
    return (term.astype(wide, copy=False) + sums.astype(wide, copy=False)).astype(dtype, copy=False)
