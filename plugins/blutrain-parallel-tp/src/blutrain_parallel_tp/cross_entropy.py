"""Softmax cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

Rank r holds the logits of classes ``vocab_start .. vocab_start + V_r`` for every row; no rank ever
holds a full row. The forward needs three all-reduces of one value per row: the row maximum (``max``),
the sum of ``exp(logit - max)`` (``sum``) and the target's logit (``sum``: only the rank owning the
target contributes it). Then ``loss_i = log(sumexp_i) + max_i - logit_i[target_i]``, averaged over the
rows whose target is not ``ignore_index`` (``reduction="sum"``: summed over them).

Backward is local: the gradient of the shard is ``(softmax - onehot) · g / n`` (``g`` for a sum) restricted to the
shard's columns, and softmax is recomputed from the saved logits and the per-row log-sum-exp, so
the rule keeps the shard it already had and one value per row.
"""

from __future__ import annotations

from typing import Any

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import save_inputs
from blutrain.dist import DistArgumentError, ProcessGroup
from blutrain.tensor import Tensor, arange, clamp, float32, get_autocast_dtype, logical_and, where

VOCAB_PARALLEL_CROSS_ENTROPY = "tp_vocab_parallel_cross_entropy"


def _check(logits: Tensor, target: Tensor, vocab_start: int) -> None:
    where_ = "vocab_parallel_cross_entropy"
    if not isinstance(logits, Tensor) or logits.ndim != 2 or not logits.dtype.is_floating:
        got = f"shape {list(logits.shape)}, dtype {logits.dtype.name}" if isinstance(logits, Tensor) else \
            type(logits).__name__
        raise DistArgumentError(f"{where_}: logits must be a floating (N, V_shard) Tensor, got {got}")
    if not isinstance(target, Tensor) or target.dtype.is_floating or target.shape != (logits.shape[0],):
        got = f"shape {list(target.shape)}, dtype {target.dtype.name}" if isinstance(target, Tensor) else \
            type(target).__name__
        raise DistArgumentError(f"{where_}: target must be an integer Tensor of shape [{logits.shape[0]}] "
                                f"(one class per row of logits), got {got}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise DistArgumentError(f"{where_}: vocab_start must be an int >= 0, got {vocab_start!r}")


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group: ProcessGroup, vocab_start: int,
                                 ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Mean (``reduction="sum"``: summed) cross-entropy of rows whose classes are split over ``group``.

    ``logits`` (N, V_shard): this rank's columns, classes ``vocab_start .. vocab_start + V_shard``;
    ``target`` (N,): global class ids, the same on every rank. Every rank gets the same scalar loss,
    and its backward gives each rank the gradient of its own columns. Under autocast the loss is float32
    whatever the logits' dtype, as :func:`blutrain.tensor.cross_entropy`'s is there (it widens its input):
    a bfloat16 loss would be rounded to 8 bits (1/16 near ln 50304) and differ from the single process's.
    """
    _check(logits, target, vocab_start)
    if reduction not in ("mean", "sum"):
        raise DistArgumentError(f"vocab_parallel_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    n_cols = logits.shape[1]
    with no_grad():
        x = logits.detach()
        if x.dtype.itemsize < 4:  # bf16/fp16 logits reduce in float32, as the fused kernel does
            x = x.to(dtype=float32)
        row_max = x.amax(dim=1, keepdim=True)
        if group.size > 1:
            group.all_reduce(row_max, op="max")
        shifted = x - row_max
        sumexp = shifted.exp().sum(dim=1, keepdim=True)
        local = target - vocab_start
        owned = logical_and(local >= 0, local < n_cols)
        picked = shifted.gather(1, where(owned, local, 0).reshape(-1, 1)) * owned.reshape(-1, 1).to(dtype=x.dtype)
        if group.size > 1:
            group.all_reduce(sumexp, op="sum")
            group.all_reduce(picked, op="sum")
        lse = sumexp.log() + row_max
        valid = (target != ignore_index).reshape(-1, 1).to(dtype=x.dtype)
        # a device value, never read on the host, so that the loss compiles (blutrain.compiler)
        count = valid.sum()
        per_row = (sumexp.log() - picked) * valid
        # every target ignored: 0 / 0 = NaN, as the mean of nothing is in PyTorch and blutrain's cross_entropy
        loss = per_row.sum() / count if reduction == "mean" else per_row.sum()
        if get_autocast_dtype() is None:
            loss = loss.to(dtype=logits.dtype)
    record(VOCAB_PARALLEL_CROSS_ENTROPY, (logits,), loss, {
        "target": target, "lse": lse, "valid": valid, "count": count if reduction == "mean" else None,
        "vocab_start": vocab_start})
    return loss


@derivative(VOCAB_PARALLEL_CROSS_ENTROPY, save=save_inputs)
def _backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    (logits,) = node.saved
    a = node.attrs
    g = grads[0]
    x = logits.detach()
    lse: Tensor = a["lse"]
    probs = (x.to(dtype=lse.dtype) - lse).exp()
    local = a["target"] - a["vocab_start"]
    n_cols = x.shape[1]
    owned = logical_and(local >= 0, local < n_cols).reshape(-1, 1)
    cols = arange(n_cols, dtype="int64", device=x.device).reshape(1, -1)
    onehot = logical_and(cols == local.reshape(-1, 1), owned).to(dtype=probs.dtype)
    scale = g.to(dtype=probs.dtype) * a["valid"]
    if a["count"] is not None:  # the mean's
        scale = scale / clamp(a["count"], min=1.0)
    grad = (probs - onehot) * scale
    return (grad.to(dtype=logits.dtype),)


__all__ = ["VOCAB_PARALLEL_CROSS_ENTROPY", "vocab_parallel_cross_entropy"]
