"""Global-norm gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from blutrain.autograd import no_grad
from blutrain.optim.errors import OptimizerError
from blutrain.optim.multi_tensor import multi_tensor_apply
from blutrain.tensor import Tensor, cat, clamp, dispatch, norm, stack, zeros
from blutrain.tensor.dtype import float32, float64

SCALE = "scale_multi_tensor"  # the kernel that scales a list of tensors in place by a 0-d tensor
NORM = "norm_multi_tensor"  # the kernel that returns the 2-norm of a list of tensors together


def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale every ``.grad`` in place so that their global L2 norm is at most ``max_norm``; return
    the norm before clipping as a 0-d tensor on the gradients' device.

    The norm is the L2 norm of all gradient elements, computed on the device; the scale factor
    ``min(1, max_norm / (norm + eps))`` stays on the device too and is applied to every gradient
    unconditionally, so this function never waits for the device. The one host sync is the
    caller's, when it reads the returned norm (``float(norm)`` for logging). A non-finite norm makes
    every gradient non-finite, as in PyTorch; check the returned value to skip such a step.
    """
    if not isinstance(max_norm, (int, float)) or not max_norm > 0 or not math.isfinite(max_norm):
        raise OptimizerError(f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm!r}")
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        dev = params[0].device if params else None
        return zeros((), device=dev)
    with no_grad():
        total = global_norm(grads)
        scale_(grads, clamp(max_norm / (total + eps), max=1.0))
    return total


def _by_dtype(tensors: Sequence[Tensor], where: str) -> dict[Any, list[Tensor]]:
    """``tensors`` grouped by dtype, checked to be on one device."""
    by_dtype: dict[Any, list[Tensor]] = {}
    for t in tensors:
        if t.device is not tensors[0].device:
            raise OptimizerError(f"{where}: tensors are on {tensors[0].device} and {t.device}; give one device's "
                                 "tensors at a time")
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype


def global_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of all elements of ``tensors`` together (0-d, in the widest of their dtypes, on their device),
    computed on the device without a host sync: one norm per dtype through the multi-tensor kernel where the
    device has it (on CUDA two launches reading each tensor once), else the norm of the tensors laid end to end
    (a flat copy); a norm per tensor would be three or four launches for each of GPT-2's 149 tensors. Not
    recorded by autograd."""
    if not tensors:
        raise OptimizerError("global_norm: got no tensors; give at least one")
    with no_grad():
        widest = max((t.dtype for t in tensors), key=lambda d: d.itemsize)
        device = tensors[0].device
        norms = []
        for dtype, same in _by_dtype(tensors, "global_norm").items():
            if dispatch.has_kernel(NORM, device.type, dtype):
                data = multi_tensor_apply(NORM, [[t.detach() for t in same]], written=())
                part = Tensor.from_array(data, float64 if dtype is float64 else float32, device)
            else:
                flat = [t.detach().reshape(-1) for t in same]
                part = norm(cat(flat) if len(flat) > 1 else flat[0])
            norms.append(part.to(dtype=widest))
        return norms[0] if len(norms) == 1 else norm(stack(norms))


def scale_(tensors: Sequence[Tensor], coef: Tensor) -> None:
    """Multiply every tensor of ``tensors`` in place by the 0-d ``coef`` (a device value, cast to each dtype):
    one multi-tensor kernel per dtype where the device has it (on CUDA one launch, not one multiply per
    tensor), else one multiply each. Not recorded by autograd."""
    with no_grad():
        for dtype, same in _by_dtype(tensors, "scale_").items():
            scale = coef if coef.dtype is dtype else coef.to(dtype=dtype)
            if not dispatch.has_kernel(SCALE, same[0].device.type, dtype):
                for t in same:
                    t.detach().mul_(scale)
                continue
            multi_tensor_apply(SCALE, [same], scale.array, written=(0,))


__all__ = ["clip_grad_norm_", "global_norm", "scale_"]
