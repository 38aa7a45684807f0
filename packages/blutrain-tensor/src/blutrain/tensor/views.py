"""Views: tensors that share their storage with another. Which reshapes can be views (``infer_shape``,
``try_view``, ``view_strides``), and Tensor's view methods (:class:`ViewMethods`)."""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from blutrain.tensor.backend import array_module
from blutrain.tensor.base import _normalize_dim, _shape_arg
from blutrain.tensor.dtype import DType
from blutrain.tensor.errors import ShapeError, TensorIndexError, TensorTypeError, TensorValueError

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor


class ViewMethods:
    """Tensor's view methods, mixed into :class:`~blutrain.tensor.tensor.Tensor`. Each result is made by the host's
    ``_view_op(op, array, attrs)``: a tensor over ``array`` (a view of the host's array) sharing the host's
    storage, recorded for autograd as ``op``. The other members declared below are the host's too."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by the host class
        array: Any

        @property
        def shape(self) -> tuple[int, ...]: ...

        @property
        def ndim(self) -> int: ...

        def numel(self) -> int: ...

        def stride(self, dim: int | None = None) -> tuple[int, ...] | int: ...

        def contiguous(self) -> Tensor: ...

        def _view_op(self, op: str, data: Any, attrs: dict[str, Any]) -> Tensor: ...

    def view(self, *shape: Any) -> Tensor:
        """Same storage, new shape; the strides must allow it (otherwise use reshape)."""
        if len(shape) == 1 and isinstance(shape[0], DType | str):
            raise TensorTypeError("view(dtype) is not supported; use to(dtype)")
        sh = infer_shape(_shape_arg(shape, "shape"), self.numel(), "view")
        new = try_view(self.array, sh)
        if new is None:
            raise ShapeError(
                f"view: shape {list(sh)} is not compatible with the strides {list(self.stride())} of a "  # type: ignore[arg-type]
                f"tensor of shape {list(self.shape)}; use reshape(), which copies when it must")
        return self._view_op("view", new, {"shape": self.shape})

    def reshape(self, *shape: Any) -> Tensor:
        """A view when the strides allow it, otherwise a contiguous copy."""
        sh = infer_shape(_shape_arg(shape, "shape"), self.numel(), "reshape")
        new = try_view(self.array, sh)
        if new is None:
            return self.contiguous().view(sh)
        return self._view_op("view", new, {"shape": self.shape})

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        if self.ndim == 0:
            return self.reshape(1)
        s = _normalize_dim(start_dim, self.ndim, "start_dim")
        e = _normalize_dim(end_dim, self.ndim, "end_dim")
        if s > e:
            raise TensorValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
        sh = (*self.shape[:s], math.prod(self.shape[s:e + 1]), *self.shape[e + 1:])
        return self.reshape(sh)

    def unflatten(self, dim: int, sizes: Sequence[int]) -> Tensor:
        d = _normalize_dim(dim, self.ndim)
        return self.reshape(self.shape[:d] + tuple(sizes) + self.shape[d + 1:])

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        d0, d1 = _normalize_dim(dim0, self.ndim, "dim0"), _normalize_dim(dim1, self.ndim, "dim1")
        if d0 == d1:
            return self._view_op("view", self.array, {"shape": self.shape})
        perm = list(range(self.ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return self._view_op("permute", self.array.transpose(perm), {"dims": tuple(perm)})

    swapaxes = transpose

    def permute(self, *dims: Any) -> Tensor:
        ds = _shape_arg(dims, "dims")
        if len(ds) != self.ndim:
            raise ShapeError(f"permute: expected {self.ndim} dims for shape {list(self.shape)}, got {list(ds)}")
        perm = tuple(_normalize_dim(d, self.ndim, "dims") for d in ds)
        if sorted(perm) != list(range(self.ndim)):
            raise TensorValueError(f"permute: dims {list(ds)} is not a permutation of 0..{self.ndim - 1}")
        return self._view_op("permute", self.array.transpose(perm), {"dims": perm})

    @property
    def T(self) -> Tensor:
        return self.permute(*reversed(range(self.ndim)))

    @property
    def mT(self) -> Tensor:
        if self.ndim < 2:
            raise ShapeError(f"mT: expects at least 2 dims, got shape {list(self.shape)}")
        return self.transpose(-2, -1)

    def movedim(self, source: int, destination: int) -> Tensor:
        s = _normalize_dim(source, self.ndim, "source")
        d = _normalize_dim(destination, self.ndim, "destination")
        perm = [i for i in range(self.ndim) if i != s]
        perm.insert(d, s)
        return self.permute(perm)

    def expand(self, *sizes: Any) -> Tensor:
        """Broadcast to ``sizes`` without copying (-1 keeps a dimension); size-1 dims repeat."""
        sz = _shape_arg(sizes, "sizes")
        if len(sz) < self.ndim:
            raise ShapeError(f"expand: target {list(sz)} has fewer dims than the tensor's shape {list(self.shape)}")
        lead = len(sz) - self.ndim
        target = tuple(
            self.shape[i - lead] if (s == -1 and i >= lead) else s for i, s in enumerate(sz))
        for i, s in enumerate(self.shape):
            if s != 1 and s != target[i + lead]:
                raise ShapeError(f"expand: cannot expand shape {list(self.shape)} to {list(sz)}")
        if any(s < 0 for s in target):
            raise ShapeError(f"expand: -1 is not allowed for a new leading dim, got {list(sz)}")
        xp = array_module(self.array)  # the array's own module: the compiler's tracer registers one
        return self._view_op("expand", xp.broadcast_to(self.array, target), {"shape": self.shape})

    def expand_as(self, other: Tensor) -> Tensor:
        return self.expand(other.shape)

    def broadcast_to(self, *shape: Any) -> Tensor:
        return self.expand(*shape)

    def squeeze(self, dim: int | Sequence[int] | None = None) -> Tensor:
        if dim is None:
            new_shape = tuple(s for s in self.shape if s != 1)
        else:
            dims = (dim,) if isinstance(dim, int) else tuple(dim)
            nd = {_normalize_dim(d, self.ndim) for d in dims}
            new_shape = tuple(s for i, s in enumerate(self.shape) if not (i in nd and s == 1))
        return self._view_op("view", self.array.reshape(new_shape), {"shape": self.shape})

    def unsqueeze(self, dim: int) -> Tensor:
        d = _normalize_dim(dim, self.ndim + 1)
        new_shape = (*self.shape[:d], 1, *self.shape[d:])
        return self._view_op("view", self.array.reshape(new_shape), {"shape": self.shape})

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        d = _normalize_dim(dim, self.ndim)
        size = self.shape[d]
        if start < 0:
            start += size
        if not (0 <= start <= size and length >= 0 and start + length <= size):
            raise TensorValueError(
                f"narrow: start {start} and length {length} are out of range for dim {dim} of size {size}")
        key = (slice(None),) * d + (slice(start, start + length),)
        return self._view_op("slice", self.array[key], {"shape": self.shape, "key": key})

    def select(self, dim: int, index: int) -> Tensor:
        d = _normalize_dim(dim, self.ndim)
        size = self.shape[d]
        if not -size <= index < size:
            raise TensorIndexError(f"select: index {index} is out of range for dim {dim} of size {size}")
        # the trailing Ellipsis makes NumPy return a 0-d view, not a scalar copy, for 1-d tensors
        key = (slice(None),) * d + (index % size, Ellipsis)
        return self._view_op("slice", self.array[key], {"shape": self.shape, "key": key})

    def split(self, split_size_or_sections: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
        d = _normalize_dim(dim, self.ndim)
        size = self.shape[d]
        if isinstance(split_size_or_sections, int):
            step = split_size_or_sections
            if step <= 0:
                raise TensorValueError(f"split: split_size must be positive, got {step}")
            sizes = [builtins.min(step, size - i) for i in range(0, size, step)] or [0]
        else:
            sizes = list(split_size_or_sections)
            if sum(sizes) != size:
                raise ShapeError(f"split: sections {sizes} do not sum to dim {dim} of size {size}")
        out, start = [], 0
        for s in sizes:
            out.append(self.narrow(d, start, s))
            start += s
        return tuple(out)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
        if chunks <= 0:
            raise TensorValueError(f"chunk: chunks must be positive, got {chunks}")
        size = self.shape[_normalize_dim(dim, self.ndim)]
        return self.split(builtins.max(-(-size // chunks), 1), dim)

    def unbind(self, dim: int = 0) -> tuple[Tensor, ...]:
        d = _normalize_dim(dim, self.ndim)
        return tuple(self.select(d, i) for i in range(self.shape[d]))

    def __iter__(self) -> Iterator[Tensor]:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]


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
