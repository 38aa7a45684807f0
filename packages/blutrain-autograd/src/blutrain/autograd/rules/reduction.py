"""Derivatives of reductions and of the softmax family."""

from __future__ import annotations

import math
from typing import Any

from blutrain.autograd.rules import derivative, no_double_backward, save_nothing, save_output
from blutrain.tensor import dispatch
from blutrain.tensor.ops import elementwise as ew
from blutrain.tensor.ops import reduction as rd
from blutrain.tensor.tensor import Tensor


def _unsqueeze_reduced(g: Tensor, dims: tuple[int, ...] | None, keepdim: bool, ndim: int) -> Tensor:
    """Put reduced dims back as size 1 so ``g`` broadcasts against the input."""
    if keepdim or ndim == 0:
        return g
    if dims is None:
        return g.reshape((1,) * ndim)
    shape = list(g.shape)
    for d in dims:
        shape.insert(d, 1)
    return g.reshape(tuple(shape))


def _count(shape: tuple[int, ...], dims: tuple[int, ...] | None) -> int:
    return math.prod(shape) if dims is None else math.prod(shape[d] for d in dims)


@derivative("sum", save=save_nothing)
def _sum(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    a = node.attrs
    g = _unsqueeze_reduced(grads[0], a["dims"], a["keepdim"], len(a["shape"]))
    return (g.expand(a["shape"]).to(dtype=grads[0].dtype),)


@derivative("mean", save=save_nothing)
def _mean(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    a = node.attrs
    g = _unsqueeze_reduced(grads[0], a["dims"], a["keepdim"], len(a["shape"]))
    return ((g / max(_count(a["shape"], a["dims"]), 1)).expand(a["shape"]),)


def _save_in_out(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return (inputs[0], outputs[0].detach())


@derivative("amax", "amin", save=_save_in_out)
def _amax(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    x, out = node.saved
    a = node.attrs
    out_b = _unsqueeze_reduced(out, a["dims"], a["keepdim"], x.ndim)
    g = _unsqueeze_reduced(grads[0], a["dims"], a["keepdim"], x.ndim)
    hit = ew.binary("eq", x, out_b).to(dtype=x.dtype)
    # ties share the gradient equally, as in PyTorch
    share = hit.sum(a["dims"], keepdim=True) if a["dims"] is not None else hit.sum().reshape((1,) * x.ndim)
    return (g * hit / share,)


def _save_indices(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return (outputs[1],)


@derivative("max_dim", "min_dim", save=_save_indices)
def _max_dim(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    (idx,) = node.saved
    a = node.attrs
    g = grads[0]
    if g is None:
        return (None,)
    from blutrain.tensor.ops import factory
    from blutrain.tensor.ops.indexing import scatter_add

    shape = a["shape"]
    if len(shape) == 0:
        return (g,)
    if not a["keepdim"]:
        g, idx = g.unsqueeze(a["dim"]), idx.unsqueeze(a["dim"])
    return (scatter_add(factory.zeros(shape, dtype=g.dtype, device=g.device), a["dim"], idx, g),)


@derivative("var")
def _var(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    (x,) = node.saved
    a = node.attrs
    n = _count(x.shape, a["dims"])
    g = _unsqueeze_reduced(grads[0], a["dims"], a["keepdim"], x.ndim)
    centered = x - rd.mean(x, a["dims"], keepdim=True)
    return (g * centered * (2.0 / max(n - a["correction"], 1)),)


@derivative("norm", save=_save_in_out)
def _norm(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    x, out = node.saved
    a = node.attrs
    p = a["p"]
    g = _unsqueeze_reduced(grads[0], a["dims"], a["keepdim"], x.ndim)
    n = _unsqueeze_reduced(out, a["dims"], a["keepdim"], x.ndim)
    if p == 2.0:
        return (g * x / ew.where(ew.binary("eq", n, 0), 1.0, n),)
    if p == 1.0:
        return (g * ew.unary("sign", x),)
    if p == float("inf"):
        hit = ew.binary("eq", ew.unary("abs", x), n).to(dtype=x.dtype)
        share = hit.sum(a["dims"], keepdim=True) if a["dims"] is not None else hit.sum()
        return (g * ew.unary("sign", x) * hit / share,)
    safe = ew.where(ew.binary("eq", n, 0), 1.0, n)
    return (g * ew.unary("sign", x) * ew.unary("abs", x) ** (p - 1) / safe ** (p - 1),)


@derivative("logsumexp", save=_save_in_out)
def _logsumexp(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    x, out = node.saved
    a = node.attrs
    g = _unsqueeze_reduced(grads[0], a["dims"], a["keepdim"], x.ndim)
    lse = _unsqueeze_reduced(out, a["dims"], a["keepdim"], x.ndim)
    return (g * ew.unary("exp", x - lse),)


@derivative("softmax", save=save_output)
def _softmax(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("softmax", create_graph)
    (y,) = node.saved
    return (dispatch.call("softmax_backward", grads[0], y, node.attrs["dim"], dtype=y.dtype),)


@derivative("log_softmax", save=save_output)
def _log_softmax(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("log_softmax", create_graph)
    (y,) = node.saved
    return (dispatch.call("log_softmax_backward", grads[0], y, node.attrs["dim"], dtype=y.dtype),)
