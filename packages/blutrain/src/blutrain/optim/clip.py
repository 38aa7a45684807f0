"""Global-norm gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
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
        dt = grads[0].dtype
        for g in grads:
            if g.device is not grads[0].device:
                raise OptimizerError(f"clip_grad_norm_: gradients are on {grads[0].device} and {g.device}; "
                                     "clip each device's gradients separately")
            if g.dtype.itemsize > dt.itemsize:
                dt = g.dtype
        # One norm per dtype over all its gradients: the multi-tensor kernel (on CUDA two launches reading
        # each gradient once), else the norm of the gradients laid end to end (a flat copy); a norm per
        # tensor would be three or four launches for each of GPT-2's 149 tensors.
        by_dtype: dict[Any, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        device = grads[0].device
        norms = []
        for dtype, same in by_dtype.items():
            if dispatch.has_kernel(NORM, device.type, dtype):
                data = multi_tensor_apply(NORM, [[g.detach() for g in same]], written=())
                part = Tensor.from_array(data, float64 if dtype is float64 else float32, device)
            else:
                flat = [g.detach().reshape(-1) for g in same]
                part = norm(cat(flat) if len(flat) > 1 else flat[0])
            norms.append(part.to(dtype=dt))
        total = norms[0] if len(norms) == 1 else norm(stack(norms))
        coef = clamp(max_norm / (total + eps), max=1.0)
        for dtype, same in by_dtype.items():
            scale = coef if coef.dtype is dtype else coef.to(dtype=dtype)
            if not dispatch.has_kernel(SCALE, device.type, dtype):  # a backend without it: one multiply each
                for g in same:
                    g.detach().mul_(scale)
                continue
            # one multi-tensor kernel for all of them (on CUDA one launch, not one multiply per tensor)
            multi_tensor_apply(SCALE, [same], scale.array, written=(0,))
    return total


__all__ = ["clip_grad_norm_"]
