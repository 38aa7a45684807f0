"""The two differentiable collectives of Megatron tensor parallelism (its ``f`` and ``g``).

``copy_to_tp_region(x)`` enters a tensor-parallel region: identity forward, all-reduce (sum) of the
gradient backward, because every rank's shard of the next layer consumed the same ``x``.
``reduce_from_tp_region(x)`` leaves it: all-reduce (sum) of the partial results forward, identity
backward, because each rank's partial sum contributed with weight one to the result.

Each is one autograd op registered through ``blutrain.autograd.derivative`` and recorded with
``blutrain.autograd.record`` (the autograd package's custom-function mechanism): the forward runs
outside recording, the rule keeps nothing for backward but the group. In a group of one both are
identities and no collective is issued.
"""

from __future__ import annotations

from typing import Any

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import save_nothing
from blutrain.dist import ProcessGroup
from blutrain.tensor import Tensor, zeros

COPY_TO_TP = "tp_copy_to_region"
REDUCE_FROM_TP = "tp_reduce_from_region"


def copy_to_tp_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """``x`` itself forward; the gradient summed over ``group`` backward."""
    if group.size == 1:
        return x
    out = x.detach()
    record(COPY_TO_TP, (x,), out, {"group": group})
    return out


def reduce_from_tp_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """``x`` summed over ``group`` forward; the gradient passed through backward."""
    if group.size == 1:
        return x
    with no_grad():
        out = x.detach().clone()
        group.all_reduce(out, op="sum")
    record(REDUCE_FROM_TP, (x,), out, {"group": group})
    return out


def grad_or_zeros(node: Any, grads: list[Any]) -> Tensor:
    """The output's gradient; zeros where it got none, since a collective must run on every rank."""
    g = grads[0]
    if g is None:
        shape, dtype, device = node.out_meta[0]
        return zeros(*shape, dtype=dtype, device=device)
    return g  # type: ignore[no-any-return]


@derivative(COPY_TO_TP, save=save_nothing)
def _copy_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    # a fresh buffer: the incoming gradient may be shared with another consumer of the output
    g = grad_or_zeros(node, grads).detach().clone()
    node.attrs["group"].all_reduce(g, op="sum")
    return (g,)


@derivative(REDUCE_FROM_TP, save=save_nothing)
def _reduce_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    return (grad_or_zeros(node, grads),)


__all__ = ["COPY_TO_TP", "REDUCE_FROM_TP", "copy_to_tp_region", "grad_or_zeros", "reduce_from_tp_region"]
