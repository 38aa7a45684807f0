"""Derivatives of elementwise ops, casts and copies. Gradients of broadcast inputs are summed back
to the input's shape; Python scalar operands get no gradient."""

from __future__ import annotations

import math
from typing import Any

from blutrain.autograd.rules import derivative, save_nothing, save_output, sum_to
from blutrain.tensor import dispatch
from blutrain.tensor.ops import elementwise as ew
from blutrain.tensor.tensor import Tensor


def _shape(x: Any) -> tuple[int, ...]:
    return x.shape if isinstance(x, Tensor) else ()


def _save_shapes(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    # only the shapes, to sum broadcast gradients back; spelled out because add and sub are the
    # most frequent recorded ops
    if len(inputs) == 2:
        a, b = inputs
        return (a.shape if isinstance(a, Tensor) else (), b.shape if isinstance(b, Tensor) else ())
    return tuple(_shape(x) for x in inputs)


@derivative("add", save=_save_shapes)
def _add(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g = grads[0]
    sa, sb = node.saved
    return (sum_to(g, sa) if node.needs[0] else None, sum_to(g, sb) if node.needs[1] else None)


@derivative("sub", save=_save_shapes)
def _sub(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g = grads[0]
    sa, sb = node.saved
    return (sum_to(g, sa) if node.needs[0] else None, sum_to(-g, sb) if node.needs[1] else None)


def _save_mul(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    a, b = inputs
    # each input's gradient needs only the *other* operand: keep no more than that
    need_a = isinstance(a, Tensor) and (a.grad_fn is not None or a.requires_grad)  # an op's output requires grad
    need_b = isinstance(b, Tensor) and (b.grad_fn is not None or b.requires_grad)
    return (b if need_a else None, a if need_b else None, _shape(a), _shape(b))


@derivative("mul", save=_save_mul)
def _mul(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g = grads[0]
    b, a, sa, sb = node.saved
    return (sum_to(g * b, sa) if node.needs[0] else None, sum_to(g * a, sb) if node.needs[1] else None)


def _save_div(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    a, b = inputs
    need_b = isinstance(b, Tensor) and (b.grad_fn is not None or b.requires_grad)
    return (b, outputs[0].detach() if need_b else None, _shape(a), _shape(b))


@derivative("div", save=_save_div)
def _div(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g = grads[0]
    b, out, sa, sb = node.saved
    ga = sum_to(g / b, sa) if node.needs[0] else None
    gb = sum_to(-g * out / b, sb) if node.needs[1] else None
    return ga, gb


def _save_pow(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    a, b = inputs
    need_b = isinstance(b, Tensor) and b.requires_grad
    return (a, b, outputs[0].detach() if need_b else None)


@derivative("pow", save=_save_pow)
def _pow(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g = grads[0]
    a, b, out = node.saved
    ga = gb = None
    if node.needs[0]:
        if isinstance(b, Tensor):
            ga = sum_to(g * b * ew.binary("pow", a, b - 1), a.shape)
        elif b == 0:
            ga = g * 0
        else:
            ga = g * b * ew.binary("pow", a, b - 1)
    if node.needs[1]:
        log_a = ew.unary("log", a) if isinstance(a, Tensor) else math.log(a)
        gb = sum_to(g * out * log_a, b.shape)
    return ga, gb


def _save_minmax(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return inputs


def _pick(op: str) -> Any:
    def rule(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
        g = grads[0]
        a, b = node.saved
        # ties split the gradient in half, as PyTorch's maximum/minimum do
        a_wins = ew.binary("gt" if op == "maximum" else "lt", a, b)
        tie = ew.binary("eq", a, b)
        wa = a_wins.to(dtype=g.dtype) + tie.to(dtype=g.dtype) * 0.5
        ga = sum_to(g * wa, _shape(a)) if node.needs[0] else None
        gb = sum_to(g * (1 - wa), _shape(b)) if node.needs[1] else None
        return ga, gb

    return rule


derivative("maximum", save=_save_minmax)(_pick("maximum"))
derivative("minimum", save=_save_minmax)(_pick("minimum"))


@derivative("neg", save=save_nothing)
def _neg(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (-grads[0],)


@derivative("exp", save=save_output)
def _exp(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] * node.saved[0],)


@derivative("expm1", save=save_output)
def _expm1(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] * (node.saved[0] + 1),)


@derivative("log")
def _log(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] / node.saved[0],)


@derivative("log1p")
def _log1p(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] / (node.saved[0] + 1),)


@derivative("sqrt", save=save_output)
def _sqrt(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] / (2 * node.saved[0]),)


@derivative("rsqrt", save=save_output)
def _rsqrt(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    y = node.saved[0]
    return (grads[0] * -0.5 * y * y * y,)


@derivative("tanh", save=save_output)
def _tanh(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    y = node.saved[0]
    return (grads[0] * (1 - y * y),)


@derivative("sigmoid", save=save_output)
def _sigmoid(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    y = node.saved[0]
    return (grads[0] * y * (1 - y),)


@derivative("sin")
def _sin(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] * ew.unary("cos", node.saved[0]),)


@derivative("cos")
def _cos(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (-grads[0] * ew.unary("sin", node.saved[0]),)


@derivative("abs")
def _abs(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0] * ew.unary("sign", node.saved[0]),)


@derivative("sign", "floor_divide", save=_save_shapes)
def _zero(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    # piecewise constant: the derivative is zero wherever it exists
    return tuple(sum_to(grads[0] * 0, shape) if need else None for need, shape in zip(node.needs, node.saved,
                                                                                      strict=True))


@derivative("remainder")
def _remainder(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    # a - b * floor(a / b): d/da = 1, d/db = -floor(a / b)
    g = grads[0]
    a, b = node.saved
    ga = sum_to(g, _shape(a)) if node.needs[0] else None
    gb = sum_to(-g * ew.binary("floor_divide", a, b), _shape(b)) if node.needs[1] else None
    return ga, gb


@derivative("relu", save=save_output)
def _relu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (ew.where(ew.binary("gt", node.saved[0], 0), grads[0], 0.0),)


@derivative("silu")
def _silu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    x = node.saved[0]
    s = ew.unary("sigmoid", x)
    return (grads[0] * s * (1 + x * (1 - s)),)


@derivative("erf")
def _erf(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    x = node.saved[0]
    return (grads[0] * (2 / math.sqrt(math.pi)) * ew.unary("exp", -(x * x)),)


@derivative("gelu")
def _gelu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    from blutrain.autograd.rules import no_double_backward

    no_double_backward("gelu", create_graph)
    x = node.saved[0]
    approximate = node.attrs.get("args", ("none",))[0]
    g = grads[0]
    return (dispatch.call("gelu_backward", g, x, approximate, dtype=x.dtype),)


def _save_where(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(_shape(x) for x in inputs)


@derivative("where", save=_save_where)
def _where(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g = grads[0]
    cond = node.attrs["condition"]
    sa, sb = node.saved
    ga = sum_to(ew.where(cond, g, 0.0), sa) if node.needs[0] else None
    gb = sum_to(ew.where(cond, 0.0, g), sb) if node.needs[1] else None
    return ga, gb


@derivative("clamp")
def _clamp(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    x = node.saved[0]
    lo, hi = node.attrs["min"], node.attrs["max"]
    keep = None
    if lo is not None:
        keep = ew.binary("ge", x, lo)
    if hi is not None:
        upper = ew.binary("le", x, hi)
        keep = upper if keep is None else ew.binary("logical_and", keep, upper)
    assert keep is not None
    return (ew.where(keep, grads[0], 0.0),)


@derivative("copy", save=save_nothing)
def _copy(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (grads[0],)


@derivative("cast", save=save_nothing)
def _cast(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (ew.cast(grads[0], node.attrs["dtype"]),)


@derivative("to_device", save=save_nothing)
def _to_device(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    return (ew.to_device(grads[0], node.attrs["device"]),)
