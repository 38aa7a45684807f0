"""Ops that build one tensor from several (cat, stack) or repeat one (repeat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from blutrain.tensor import dispatch
from blutrain.tensor.base import TensorBase, _normalize_dim
from blutrain.tensor.errors import DeviceMismatchError, ShapeError, TensorTypeError
from blutrain.tensor.ops.elementwise import result_type

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

_grad_mode = dispatch.grad_mode
_kernel = dispatch.kernel


def _check_many(op: str, tensors: Sequence[Tensor]) -> None:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TensorTypeError(f"{op}: expected a non-empty list or tuple of Tensors, got {tensors!r}")
    for i, t in enumerate(tensors):
        if not isinstance(t, TensorBase):
            raise TensorTypeError(f"{op}: element {i} is a {type(t).__name__}, not a Tensor")
        if t.device is not tensors[0].device:
            raise DeviceMismatchError(f"{op}: element {i} is on {t.device}, element 0 on {tensors[0].device}")


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Join along an existing dim; every other dim must match."""
    _check_many("cat", tensors)
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors[:1])
    ref = parts[0]
    d = _normalize_dim(dim, ref.ndim)
    for i, t in enumerate(parts):
        if t.ndim != ref.ndim or any(a != b for j, (a, b) in enumerate(zip(t.shape, ref.shape, strict=True))
                                     if j != d):
            raise ShapeError(f"cat: tensor {i} has shape {list(t.shape)}, which does not match "
                             f"{list(ref.shape)} outside dim {d}")
    dt = result_type(*parts)
    arrays = [t.array if t.dtype is dt else t.array.astype(dt.np) for t in parts]
    out = ref._make(_kernel("cat", ref.device.type, dt)(arrays, d), dt, ref.device)
    if _grad_mode.enabled and any(t._rg for t in parts) and dispatch.recorder is not None:
        dispatch.recorder("cat", tuple(parts), out, {"dim": d, "sizes": [t.shape[d] for t in parts]})
    return out


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Join along a new dim; all shapes must be equal."""
    _check_many("stack", tensors)
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise ShapeError(f"stack: tensor {i} has shape {list(t.shape)}, tensor 0 has {list(shape)}")
    d = _normalize_dim(dim, len(shape) + 1)
    return cat([t.unsqueeze(d) for t in tensors], d)


def repeat(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """Tile ``x`` (like ``torch.Tensor.repeat``): a copy, sizes must cover every dim."""
    if len(sizes) < x.ndim:
        raise ShapeError(f"repeat: needs at least {x.ndim} sizes for shape {list(x.shape)}, got {list(sizes)}")
    lead = len(sizes) - x.ndim
    out = x.reshape((1,) * lead + x.shape)
    for axis, times in enumerate(sizes):
        if times != 1:
            out = cat([out] * times, axis) if times > 0 else out.narrow(axis, 0, 0)
    return out.clone() if out.storage is x.storage else out
