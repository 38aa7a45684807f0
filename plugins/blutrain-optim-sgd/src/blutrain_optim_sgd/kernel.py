"""The "sgd_multi_tensor" kernel, devices "cpu" and "cuda": one call updates every parameter of a bucket.

Generic over the array module (NumPy or CuPy), in place. A backend with a fused kernel replaces it on its
device by registering the same op name with a higher priority.
"""

from __future__ import annotations

from typing import Any

from blutrain.tensor import array_module

Array = Any


def sgd_multi_tensor(params: list[Array], grads: list[Array], momentum_buffers: list[Array], lr: float,
                     momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                     first: bool) -> None:
    """SGD as PyTorch computes it: d = g + wd·p; with momentum, b ← d on the first step and
    b ← μ·b + (1−τ)·d after, then d = d + μ·b (Nesterov) or d = b; finally p ← p − lr·d.
    ``momentum_buffers`` is empty when ``momentum`` is 0; ``first`` says the buffers are new."""
    if momentum != 0.0 and len(momentum_buffers) != len(params):
        raise ValueError(f"sgd_multi_tensor: {len(params)} params but {len(momentum_buffers)} momentum "
                         "buffers")
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        xp = array_module(p)
        d = g if weight_decay == 0.0 else g + weight_decay * p
        if momentum != 0.0:
            buf = momentum_buffers[i]
            if first:
                buf[...] = d
            else:
                buf *= momentum
                buf += d if dampening == 0.0 else (1.0 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p -= xp.multiply(d, lr)


__all__ = ["sgd_multi_tensor"]
