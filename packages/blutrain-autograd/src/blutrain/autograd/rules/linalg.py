"""Derivatives of matmul and linear."""

from __future__ import annotations

from typing import Any

from blutrain.autograd.rules import derivative, no_double_backward, save_inputs, save_nothing, sum_to
from blutrain.tensor import dispatch
from blutrain.tensor.dtype import float32
from blutrain.tensor.ops.factory import zeros
from blutrain.tensor.ops.linalg import matmul
from blutrain.tensor.tensor import Tensor


@derivative("matmul", save=save_inputs)
def _matmul(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    g: Tensor = grads[0]
    a, b = node.saved
    ga = gb = None
    # 1-D operands are promoted to matrices for the product and squeezed back afterwards
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    g2 = g
    if a.ndim == 1:
        g2 = g2.unsqueeze(-2)
    if b.ndim == 1:
        g2 = g2.unsqueeze(-1)
    if node.needs[0]:
        ga = sum_to(matmul(g2, b2.mT), a2.shape)
        ga = ga.reshape(a.shape)
    if node.needs[1]:
        gb = sum_to(matmul(a2.mT, g2), b2.shape)
        gb = gb.reshape(b.shape)
    return ga, gb


@derivative("linear", save=save_inputs)
def _linear(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("linear", create_graph)
    x, w, _ = node.saved
    return dispatch.call_multi("linear_backward", grads[0], x, w, *node.needs, dtype=x.dtype)


def _linear_backward(g: Tensor, x: Tensor, w: Tensor, needs: tuple[bool, bool, bool], wides: tuple[bool, bool, bool],
                     dtypes: tuple[Any, ...]) -> list[Tensor | None]:
    """linear_backward's gradients (computed in float32 where ``wides`` says so, else in x's dtype) as tensors
    of their operands' ``dtypes`` (a float32 operand narrowed by autocast gets its gradient in float32)."""
    grads = dispatch.call_multi("linear_backward", g, x, w, *needs, *wides[:2], dtype=x.dtype,
                                out_dtypes=[float32 if wide else x.dtype for wide in wides])
    return [grad if grad is None or grad.dtype is dt else grad.to(dtype=dt)
            for grad, dt in zip(grads, dtypes, strict=True)]


def _product_grads(g: Tensor, x: Tensor, w: Tensor, need_x: bool, need_w: bool,
                   dtypes: tuple[Any, ...]) -> list[Tensor | None]:
    """The input and weight gradients of ``x Wᵀ`` from the output gradient ``g`` (x's dtype), in the
    dtypes of the operands before autocast narrowed them (``dtypes``: input's and weight's)."""
    wide_x, wide_w = (d is float32 and d is not x.dtype for d in dtypes)
    return _linear_backward(g, x, w, (need_x, need_w, False), (wide_x, wide_w, False), (*dtypes, None))[:2]


@derivative("linear_autocast", save=save_nothing)
def _linear_autocast(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    """linear under autocast: the backward GEMMs read the narrow operands the forward kept and write the
    gradients of float32 operands in float32 (``wide``), without rounding them to the half dtype."""
    no_double_backward("linear", create_graph)
    g: Tensor = grads[0]
    x, w = node.attrs["x"], node.attrs["weight"]
    dtypes = node.attrs["dtypes"]
    wide_x, wide_w = (d is float32 and d is not x.dtype for d in dtypes[:2])
    return tuple(_linear_backward(g, x, w, node.needs, (wide_x, wide_w, wide_w), dtypes))


@derivative("linear_add", save=save_nothing)
def _linear_add(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    """The residual's gradient is the output's; the product's are linear's, from the output gradient in the
    operands' dtype (one cast under autocast, as ``+``'s backward would make), and the bias's is the sum of
    the output gradient in its own dtype (float32 under autocast: no rounding before the sum)."""
    no_double_backward("linear_add", create_graph)
    g: Tensor = grads[0]
    x, w = node.attrs["x"], node.attrs["weight"]
    dtypes = node.attrs["dtypes"]
    need_r, need_x, need_w, need_b = node.needs
    gx = gw = gb = None
    if need_x or need_w:
        gc = g if g.dtype is x.dtype else g.to(dtype=x.dtype)
        gx, gw = _product_grads(gc, x, w, need_x, need_w, dtypes[1:3])
    if need_b:
        gb = g.reshape(-1, g.shape[-1]).sum(dim=0)
    return (g if need_r else None), gx, gw, gb


@derivative("linear_gelu", save=save_nothing)
def _linear_gelu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    """The activation's derivative at the kept pre-activation (with the bias gradient's column sums in the
    same kernel, through bias_gelu's backward at a zero bias), then linear's input and weight gradients
    from it; float32 operands under autocast get theirs in float32 (``wide``), as ``linear`` does."""
    no_double_backward("linear_gelu", create_graph)
    g: Tensor = grads[0]
    x, w, pre = node.attrs["x"], node.attrs["weight"], node.attrs["pre"]
    approximate, dtypes = node.attrs["approximate"], node.attrs["dtypes"]
    need_x, need_w, need_b = node.needs
    gb = None
    if need_b:
        zero = zeros(pre.shape[-1], dtype=pre.dtype, device=pre.device)
        dpre_or_none, gb = dispatch.call_multi("bias_gelu_backward", g, pre, zero, approximate, True, dtype=pre.dtype)
        assert dpre_or_none is not None and gb is not None  # the kernel returns both when asked for the bias's
        dpre = dpre_or_none
        gb = gb if gb.dtype is dtypes[2] else gb.to(dtype=dtypes[2])
    else:
        dpre = dispatch.call("gelu_backward", g, pre, approximate, dtype=pre.dtype)
    gx = gw = None
    if need_x or need_w:
        gx, gw = _product_grads(dpre, x, w, need_x, need_w, dtypes[:2])
    return gx, gw, gb
