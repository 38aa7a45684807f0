"""Which reshapes of an array are views: the shape a ``view``/``reshape`` asks for, and the strides that give it
over the same memory when there are any."""

from __future__ import annotations

from typing import Any

import numpy as np

from blutrain.tensor.backend import array_module
from blutrain.tensor.errors import ShapeError


def infer_shape(shape: tuple[int, ...], numel: int, op: str) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ShapeError(f"{op}: only one dimension can be -1, got {list(shape)}")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        if known == 0 or numel % known:
            raise ShapeError(f"{op}: shape {list(shape)} is invalid for a tensor of {numel} elements")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if any(s < 0 for s in shape) or int(np.prod(shape)) != numel:
        raise ShapeError(f"{op}: shape {list(shape)} is invalid for a tensor of {numel} elements")
    return shape


def try_view(data: Any, shape: tuple[int, ...]) -> Any:
    """A view of ``data`` with ``shape``, or None when the strides make a copy necessary."""
    if data.flags.c_contiguous:
        return data.reshape(shape)
    strides = view_strides(data.shape, data.strides, shape)
    if strides is None:
        return None
    return array_module(data).lib.stride_tricks.as_strided(data, shape, strides)


def view_strides(old_shape: tuple[int, ...], old_strides: tuple[int, ...],
                  shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides (bytes) that give ``shape`` over the same memory, or None if there are none.

    PyTorch's rule (``computeStride``): the old dims split into chunks that are contiguous with each
    other; a new shape is a view only if it regroups each chunk on its own, never across chunks.
    """
    new = [0] * len(shape)
    view_d = len(shape) - 1
    chunk_stride = old_strides[-1]
    tensor_numel = view_numel = 1
    for d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[d]
        if d == 0 or (old_shape[d - 1] != 1 and old_strides[d - 1] != tensor_numel * chunk_stride):
            while view_d >= 0 and (view_numel < tensor_numel or shape[view_d] == 1):
                new[view_d] = view_numel * chunk_stride
                view_numel *= shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_stride = old_strides[d - 1]
                tensor_numel = view_numel = 1
    return tuple(new) if view_d == -1 else None
