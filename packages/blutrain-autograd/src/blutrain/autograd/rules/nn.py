"""Derivatives of the fused transformer ops; each calls its fused backward kernel.

What each saves is decided here: LayerNorm and RMSNorm keep the input and the per-row statistics;
cross-entropy keeps the logits and per-row log-sum-exp (no softmax tensor); attention keeps q, k, v
(packed self-attention: the one qkv tensor), its output and the log-sum-exp (no T×S matrix);
bias+GELU keeps its input and bias (not their sum; the backward kernel adds them again); rope keeps only
its angles (cos, sin: its backward is the inverse rotation); swiglu keeps gate and up; dropout keeps
its boolean mask; embedding keeps only the indices; the fused LM-head loss (linear_cross_entropy)
keeps the input and weight gradients its forward already computed, nothing of the logits.
"""

from __future__ import annotations

from typing import Any

from blutrain.autograd.rules import derivative, no_double_backward, save_inputs, save_nothing
from blutrain.tensor import dispatch, zeros
from blutrain.tensor.tensor import Tensor


def _wrap(data: Any, like: Tensor) -> Tensor | None:
    return None if data is None else Tensor._make(data, like.dtype, like.device)


def _save_ln(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    x, w, _ = inputs
    return (x, w, attrs["mean"], attrs["rstd"])


@derivative("layer_norm", save=_save_ln)
def _layer_norm(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("layer_norm", create_graph)
    x, w, mean, rstd = node.saved
    gx, gw, gb = dispatch.kernel("layer_norm_backward", x.device.type, x.dtype)(
        grads[0]._data, x._data, None if w is None else w._data, mean._data, rstd._data, node.attrs["k"],
        node.needs[1], node.needs[2])
    return (_wrap(gx, x) if node.needs[0] else None, _wrap(gw, x), _wrap(gb, x))


def _save_rms(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    x, w = inputs
    return (x, w, attrs["rstd"])


@derivative("rms_norm", save=_save_rms)
def _rms_norm(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("rms_norm", create_graph)
    x, w, rstd = node.saved
    gx, gw = dispatch.kernel("rms_norm_backward", x.device.type, x.dtype)(
        grads[0]._data, x._data, None if w is None else w._data, rstd._data, node.attrs["k"], node.needs[1])
    return (_wrap(gx, x) if node.needs[0] else None, _wrap(gw, x))


def _save_angles(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return ()  # the angles are attributes (cos, sin); rope keeps no activation


@derivative("rope", save=_save_angles)
def _rope(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("rope", create_graph)
    gq, gk = grads  # an output no loss reads has no gradient: zero
    like = gq if gq is not None else gk
    shapes = [meta[0] for meta in node.out_meta]
    gq_data = gq._data if gq is not None else _zeros_like(like, shapes[0])
    gk_data = gk._data if gk is not None else _zeros_like(like, shapes[1])
    dq, dk = dispatch.kernel("rope_backward", like.device.type, like.dtype)(
        gq_data, gk_data, node.attrs["cos"]._data, node.attrs["sin"]._data)
    return (_wrap(dq, like) if node.needs[0] else None, _wrap(dk, like) if node.needs[1] else None)


def _zeros_like(like: Tensor, shape: tuple[int, ...]) -> Any:
    return zeros(*shape, dtype=like.dtype, device=like.device)._data


@derivative("swiglu", save=save_inputs)
def _swiglu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("swiglu", create_graph)
    gate, up = node.saved
    gg, gu = dispatch.kernel("swiglu_backward", gate.device.type, gate.dtype)(
        grads[0]._data, gate._data, up._data, node.needs[0], node.needs[1])
    return (_wrap(gg, gate), _wrap(gu, gate))


@derivative("bias_gelu", save=save_inputs)
def _bias_gelu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("bias_gelu", create_graph)
    x, b = node.saved
    gx, gb = dispatch.kernel("bias_gelu_backward", x.device.type, x.dtype)(
        grads[0]._data, x._data, b._data, node.attrs["approximate"], node.needs[1])
    return (_wrap(gx, x) if node.needs[0] else None, _wrap(gb, x))


@derivative("dropout", save=save_nothing)
def _dropout(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    p = node.attrs["p"]
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return (grads[0] * node.attrs["mask"].to(dtype=grads[0].dtype) * scale,)


@derivative("embedding", save=save_nothing)
def _embedding(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("embedding", create_graph)
    g: Tensor = grads[0]
    idx = node.attrs["index"]
    num = node.attrs.get("num_embeddings")
    if num is None:
        raise AssertionError("embedding node lost its size")
    data = dispatch.kernel("embedding_backward", g.device.type, g.dtype)(g._data, idx._data, num)
    return (_wrap(data, g),)


@derivative("cross_entropy", save=save_inputs)
def _cross_entropy(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("cross_entropy", create_graph)
    (logits,) = node.saved
    a = node.attrs
    g: Tensor = grads[0]
    data = dispatch.kernel("cross_entropy_backward", logits.device.type, logits.dtype)(
        g._data, logits._data, a["target"]._data, a["lse"]._data, a["ignore_index"], a["label_smoothing"],
        a["reduction"])
    return (_wrap(data, logits),)


@derivative("linear_cross_entropy", save=save_nothing)
def _linear_cross_entropy(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("linear_cross_entropy", create_graph)
    a = node.attrs
    scale = grads[0].to(dtype=a["scale"].dtype) * a["scale"]  # upstream gradient × (1/count or 1)
    need_x, need_w = node.needs
    dx, dw = a["dx"], a["dw"]
    return (dx * scale.to(dtype=dx.dtype) if need_x and dx is not None else None,
            dw * scale.to(dtype=dw.dtype) if need_w and dw is not None else None)


def _save_sdpa(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    q, k, v = inputs
    return (q, k, v, outputs[0].detach(), attrs["lse"])


@derivative("sdpa", save=_save_sdpa)
def _sdpa(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("scaled_dot_product_attention", create_graph)
    q, k, v, out, lse = node.saved
    a = node.attrs
    dq, dk, dv = dispatch.kernel("sdpa_backward", q.device.type, q.dtype)(
        grads[0]._data, q._data, k._data, v._data, out._data, lse._data, a["mask"], a["causal"], a["scale"])
    return tuple(_wrap(d, q) if need else None for d, need in zip((dq, dk, dv), node.needs, strict=True))


def _save_sdpa_packed(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return (inputs[0], outputs[0].detach(), attrs["lse"])


@derivative("sdpa_packed", save=_save_sdpa_packed)
def _sdpa_packed(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("self_attention", create_graph)
    qkv, out, lse = node.saved
    a = node.attrs
    dqkv = dispatch.kernel("sdpa_packed_backward", qkv.device.type, qkv.dtype)(
        grads[0]._data, qkv._data, out._data, lse._data, a["n_head"], a["causal"], a["scale"])
    return (_wrap(dqkv, qkv),)
