"""The "sgd_multi_tensor" kernel, devices "cpu" and "cuda": one call updates every parameter of a bucket.

Generic over the array module (NumPy or CuPy), in place. A backend with a fused kernel replaces it on its
device by registering the same op name with a higher priority.

The learning rate, which a schedule changes from step to step, comes in ``step_scalars``, a float64
array on the parameters' device (see ``blutrain.optim.StepScalars``), so that a compiled step replays
with each step's rate.
"""

from __future__ import annotations

from typing import Any

from blutrain.tensor import array_module

Array = Any


def sgd_multi_tensor(params: list[Array], grads: list[Array], momentum_buffers: list[Array], step_scalars: Array,
                     momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                     first: bool) -> None:
    """SGD as PyTorch computes it: d = g + wd·p; with momentum, b ← d on the first step and
    b ← μ·b + (1−τ)·d after, then d = d + μ·b (Nesterov) or d = b; finally p ← p − lr·d.
    ``step_scalars`` is float64 [1] on the parameters' device: (lr,). ``momentum_buffers`` is empty
    when ``momentum`` is 0; ``first`` says the buffers are new."""
    if step_scalars.dtype != "float64" or step_scalars.shape != (1,):
        raise ValueError(f"sgd_multi_tensor: step_scalars must be a float64 array of shape (1,) (lr), got "
                         f"{step_scalars.dtype} {tuple(step_scalars.shape)}")
    if momentum != 0.0 and len(momentum_buffers) != len(params):
        raise ValueError(f"sgd_multi_tensor: {len(params)} params but {len(momentum_buffers)} momentum "
                         "buffers")
    if not params:
        return
    # Rounded once to the parameters' dtype, as a Python float lr was: the same bits.
    lr = step_scalars[0].astype(params[0].dtype)
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
