"""The "adamw_multi_tensor" kernel for device "cpu": one call updates every parameter of a bucket.

Generic over the array module (NumPy here; the same code runs on CuPy arrays), in place, with one
temporary per tensor. A CUDA backend replaces it by registering the same op name for "cuda" (one
multi-tensor-apply launch); a faster CPU kernel can take over with a higher priority.

The numbers that change every step (the learning rate and the bias corrections) come in
``step_scalars``, a float64 array on the parameters' device (see ``blutrain.optim.StepScalars``), so
that a compiled step replays with each step's values; :func:`adamw_step_scalars` computes them.
"""

from __future__ import annotations

import math
from typing import Any

from blutrain.tensor import array_module
from blutrain.tensor.errors import TensorTypeError

Array = Any


def adamw_step_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float, float]:
    """The ``step_scalars`` of step ``step`` (counting from 1): lr, 1 − β1ᵗ and √(1 − β2ᵗ)."""
    return lr, 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def adamw_multi_tensor(params: list[Array], grads: list[Array], exp_avgs: list[Array],
                       exp_avg_sqs: list[Array], step_scalars: Array, beta1: float, beta2: float, eps: float,
                       weight_decay: float, grad_scale: Array | None = None) -> None:
    """AdamW (Loshchilov & Hutter) as PyTorch computes it, for tensors that have all taken t steps:

    p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
    p ← p − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + eps)

    ``step_scalars``: float64 [3] on the parameters' device, (lr, 1 − β1ᵗ, √(1 − β2ᵗ)).

    ``grad_scale``: None, or a 0-d array of the gradients' dtype on their device, read when the kernel runs:
    g is ``grad · grad_scale``, the product rounded to that dtype, as ``scale_multi_tensor`` stores it (the same
    ufunc on the same operands), so the step equals scaling the gradients in place first and updating after,
    bit for bit, and leaves the gradients as they were. The compiler's ``adamw-grad-scale`` pass hands the
    global-norm clip's coefficient over this way when nothing else reads the scaled gradients.
    """
    if step_scalars.dtype != "float64" or step_scalars.shape != (3,):
        raise ValueError(f"adamw_multi_tensor: step_scalars must be a float64 array of shape (3,) (lr, 1 - beta1**t, "
                         f"sqrt(1 - beta2**t)), got {step_scalars.dtype} {tuple(step_scalars.shape)}")
    if not params:
        return
    dtype = params[0].dtype
    if grad_scale is not None:
        # another dtype would round the product differently from the in-place scale this stands for, which
        # takes one dtype for the gradients and the coefficient alike (the cuda kernel checks the same)
        if getattr(grad_scale, "shape", None) != () or getattr(grad_scale, "dtype", None) != grads[0].dtype:
            raise TensorTypeError(f"adamw_multi_tensor: grad_scale must be a 0-d array of the gradients' dtype "
                                  f"{grads[0].dtype}, got {getattr(grad_scale, 'dtype', type(grad_scale).__name__)} "
                                  f"{tuple(getattr(grad_scale, 'shape', ()))}")
        for i, g in enumerate(grads):
            if g.dtype != grad_scale.dtype:
                raise TensorTypeError(f"adamw_multi_tensor: grad {i} has dtype {g.dtype}, grad_scale "
                                      f"{grad_scale.dtype}; grad_scale must have every gradient's dtype")
    # The host computed these in float64 and the ufuncs took them as Python floats, rounded to the
    # parameters' dtype: the same float64 arithmetic and one rounding here give the same bits.
    lr, bias_correction1, bias_correction2_sqrt = step_scalars[0], step_scalars[1], step_scalars[2]
    step_size = (lr / bias_correction1).astype(dtype)
    decay = (1.0 - lr * weight_decay).astype(dtype)
    bias_correction2_sqrt = bias_correction2_sqrt.astype(dtype)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        xp = array_module(p)
        if weight_decay != 0.0:
            p *= decay
        if grad_scale is not None:
            g = xp.multiply(g, grad_scale)  # a new array: the caller's gradient stays unscaled
        tmp = xp.multiply(g, 1.0 - beta1)
        m *= beta1
        m += tmp
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - beta2
        v *= beta2
        v += tmp
        xp.sqrt(v, out=tmp)
        tmp /= bias_correction2_sqrt
        tmp += eps
        xp.divide(m, tmp, out=tmp)
        tmp *= step_size
        p -= tmp


__all__ = ["adamw_multi_tensor", "adamw_step_scalars"]
