"""Derivatives of views (reshape, permute, expand, basic slicing) and of cat."""

from __future__ import annotations

from typing import Any

from blutrain.autograd.rules import derivative, save_nothing, sum_to
from blutrain.tensor.ops import factory
from blutrain.tensor.tensor import Tensor


@derivative("view", save=save_nothing)
def _view(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0].reshape(node.attrs["shape"]),)


@derivative("permute", save=save_nothing)
def _permute(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    dims = node.attrs["dims"]
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return (grads[0].permute(inverse),)


@derivative("expand", save=save_nothing)
def _expand(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (sum_to(grads[0], node.attrs["shape"]),)


@derivative("slice", save=save_nothing)
def _slice(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    out = factory.zeros(node.attrs["shape"], dtype=g.dtype, device=g.device)
    out.array[node.attrs["key"]] = g.array  # a fresh tensor: no version to bump
    if create_graph:
        from blutrain.autograd.rules import no_double_backward

        no_double_backward("slicing", create_graph)
    return (out,)


@derivative("cat", save=save_nothing)
def _cat(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    parts = g.split(node.attrs["sizes"], node.attrs["dim"])
    return tuple(p if need else None for p, need in zip(parts, node.needs, strict=True))
