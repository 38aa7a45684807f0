"""Derivatives of gathers (the gradient scatters back) and scatters (the gradient gathers)."""

from __future__ import annotations

from typing import Any

from blutrain.autograd.rules import derivative, no_double_backward, save_nothing
from blutrain.tensor.ops import factory
from blutrain.tensor.ops import indexing as ix
from blutrain.tensor.tensor import Tensor


@derivative("index", save=save_nothing)
def _index(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("advanced indexing", create_graph)
    g: Tensor = grads[0]
    out = factory.zeros(node.attrs["shape"], dtype=g.dtype, device=g.device)
    from blutrain.tensor import dispatch

    dispatch.kernel("index_put", g.device.type, g.dtype)(out.array, node.attrs["key"], g.array, True)  # into out
    return (out,)


@derivative("index_select", save=save_nothing)
def _index_select(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    a = node.attrs
    zeros = factory.zeros(a["shape"], dtype=g.dtype, device=g.device)
    return (ix.index_add(zeros, a["dim"], a["index"], g),)


@derivative("gather", save=save_nothing)
def _gather(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    a = node.attrs
    zeros = factory.zeros(a["shape"], dtype=g.dtype, device=g.device)
    return (ix.scatter_add(zeros, a["dim"], a["index"], g),)


@derivative("scatter_add", save=save_nothing)
def _scatter_add(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    a = node.attrs
    return (g if node.needs[0] else None, ix.gather(g, a["dim"], a["index"]) if node.needs[1] else None)


@derivative("index_add", save=save_nothing)
def _index_add(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    a = node.attrs
    return (g if node.needs[0] else None, ix.index_select(g, a["dim"], a["index"]) if node.needs[1] else None)


@derivative("tril", save=save_nothing)
def _tril(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (ix.tril(grads[0], node.attrs["diagonal"]),)


@derivative("triu", save=save_nothing)
def _triu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (ix.triu(grads[0], node.attrs["diagonal"]),)
