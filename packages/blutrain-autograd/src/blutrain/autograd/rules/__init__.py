"""Derivative rules, one module per op family; ``RULES`` maps an op name to its :class:`Rule`.

A rule says what its op keeps for backward (``save``, called at record time: memory is a decision
made here, visibly) and how to turn output gradients into input gradients (``backward``). Rules
written with tensor ops are themselves differentiable (``create_graph``); rules that call a fused
backward kernel say so and refuse double backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from blutrain.tensor.errors import AutogradError
from blutrain.tensor.tensor import Tensor

Save = Callable[[tuple[Any, ...], tuple[Tensor, ...], dict[str, Any]], tuple[Any, ...]]
Backward = Callable[[Any, list[Any], bool], Sequence[Tensor | None]]


class Rule:
    __slots__ = ("backward", "save")

    def __init__(self, save: Save, backward: Backward) -> None:
        self.save = save
        self.backward = backward


RULES: dict[str, Rule] = {}


def save_inputs(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return inputs


def save_nothing(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return ()


def save_output(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return (outputs[0].detach(),)


def derivative(*ops: str, save: Save = save_inputs) -> Callable[[Backward], Backward]:
    """Register ``fn(node, grads, create_graph) -> input grads`` as the rule of ``ops``."""

    def register(fn: Backward) -> Backward:
        for op in ops:
            RULES[op] = Rule(save, fn)
        return fn

    return register


def no_double_backward(op: str, create_graph: bool) -> None:
    if create_graph:
        raise AutogradError(f"double backward through {op} is not supported: its backward is a fused kernel")


def sum_to(g: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape) if s == 1 and g.shape[i + lead] != 1)
    out = g.sum(dims, keepdim=True) if dims else g
    return out.reshape(shape)


from blutrain.autograd.rules import elementwise, indexing, linalg, nn, reduction, shape  # noqa: E402

__all__ = ["RULES", "Rule", "derivative", "elementwise", "indexing", "linalg", "nn", "reduction", "shape"]
