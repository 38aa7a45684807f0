"""Parameter groups as nanoGPT builds them: weight decay on matrices, none on vectors."""

from __future__ import annotations

from collections.abc import Iterable

from blutrain.optim.errors import OptimizerError
from blutrain.optim.optimizer import ParamGroup
from blutrain.tensor import Tensor


def weight_decay_groups(params: Iterable[Tensor], weight_decay: float) -> list[ParamGroup]:
    """``[{"params": <2-D and up>, "weight_decay": weight_decay}, {"params": <0/1-D>, "weight_decay": 0.0}]``.

    As nanoGPT: every tensor with two or more dims (linear weights *and* the token and position
    embeddings) is decayed; biases and LayerNorm gains/shifts are not. Empty groups are left out.
    Parameters that do not require grad are skipped.
    """
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise OptimizerError(f"weight_decay_groups: weight_decay must be a number >= 0, got {weight_decay!r}")
    decay: list[Tensor] = []
    no_decay: list[Tensor] = []
    for p in params:
        if not isinstance(p, Tensor):
            raise OptimizerError(f"weight_decay_groups: params must be Tensors, got {type(p).__name__}")
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups: list[ParamGroup] = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(weight_decay)})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if not groups:
        raise OptimizerError("weight_decay_groups: no parameter requires grad")
    return groups


__all__ = ["weight_decay_groups"]
