"""The "adamw_multi_tensor" kernel for device "cpu": one call updates every parameter of a bucket.

Generic over the array module (NumPy here; the same code runs on CuPy arrays), in place, with one
temporary per tensor. A CUDA backend replaces it by registering the same op name for "cuda" (one
multi-tensor-apply launch); a faster CPU kernel can take over with a higher priority.
"""

from __future__ import annotations

import math
from typing import Any

from blutrain.tensor import array_module

Array = Any


def adamw_multi_tensor(params: list[Array], grads: list[Array], exp_avgs: list[Array],
                       exp_avg_sqs: list[Array], lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int) -> None:
    """AdamW (Loshchilov & Hutter) as PyTorch computes it, for tensors that have all taken ``step`` steps:

    p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
    p ← p − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + eps)
    """
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    step_size = lr / bias_correction1
    decay = 1.0 - lr * weight_decay
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        xp = array_module(p)
        if weight_decay != 0.0:
            p *= decay
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


__all__ = ["adamw_multi_tensor"]
