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


def _save_ln(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    x, w, _ = inputs
    return (x, w, attrs["mean"], attrs["rstd"])


@derivative("layer_norm", save=_save_ln)
def _layer_norm(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("layer_norm", create_graph)
    x, w, mean, rstd = node.saved
    gx, gw, gb = dispatch.call_multi("layer_norm_backward", grads[0], x, w, mean, rstd, node.attrs["k"],
                                     node.needs[1], node.needs[2], dtype=x.dtype)
    return (gx if node.needs[0] else None, gw, gb)


def _save_rms(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    x, w = inputs
    return (x, w, attrs["rstd"])


@derivative("rms_norm", save=_save_rms)
def _rms_norm(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("rms_norm", create_graph)
    x, w, rstd = node.saved
    gx, gw = dispatch.call_multi("rms_norm_backward", grads[0], x, w, rstd, node.attrs["k"], node.needs[1],
                                 dtype=x.dtype)
    return (gx if node.needs[0] else None, gw)


def _save_angles(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return ()  # the angles are attributes (cos, sin); rope keeps no activation


@derivative("rope", save=_save_angles)
def _rope(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("rope", create_graph)
    gq, gk = grads  # an output no loss reads has no gradient: zero
    like = gq if gq is not None else gk
    shapes = [meta[0] for meta in node.out_meta]
    if gq is None:
        gq = zeros(*shapes[0], dtype=like.dtype, device=like.device)
    if gk is None:
        gk = zeros(*shapes[1], dtype=like.dtype, device=like.device)
    dq, dk = dispatch.call_multi("rope_backward", gq, gk, node.attrs["cos"], node.attrs["sin"], dtype=like.dtype)
    return (dq if node.needs[0] else None, dk if node.needs[1] else None)


@derivative("swiglu", save=save_inputs)
def _swiglu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("swiglu", create_graph)
    gate, up = node.saved
    return dispatch.call_multi("swiglu_backward", grads[0], gate, up, node.needs[0], node.needs[1], dtype=gate.dtype)


@derivative("bias_gelu", save=save_inputs)
def _bias_gelu(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("bias_gelu", create_graph)
    x, b = node.saved
    gx, gb = dispatch.call_multi("bias_gelu_backward", grads[0], x, b, node.attrs["approximate"], node.needs[1],
                                 dtype=x.dtype)
    return (gx if node.needs[0] else None, gb)


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
    return (dispatch.call("embedding_backward", g, idx, num),)


@derivative("cross_entropy", save=save_inputs)
def _cross_entropy(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("cross_entropy", create_graph)
    (logits,) = node.saved
    a = node.attrs
    g: Tensor = grads[0]
    return (dispatch.call("cross_entropy_backward", g, logits, a["target"], a["lse"], a["ignore_index"],
                          a["label_smoothing"], a["reduction"], dtype=logits.dtype),)


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
    grads_qkv = dispatch.call_multi("sdpa_backward", grads[0], q, k, v, out, lse, a["mask"], a["causal"], a["scale"],
                                    dtype=q.dtype)
    return tuple(d if need else None for d, need in zip(grads_qkv, node.needs, strict=True))


def _save_sdpa_packed(inputs: tuple[Any, ...], outputs: tuple[Tensor, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    return (inputs[0], outputs[0].detach(), attrs["lse"])


@derivative("sdpa_packed", save=_save_sdpa_packed)
def _sdpa_packed(node: Any, grads: list[Any], create_graph: bool) -> tuple[Any, ...]:
    no_double_backward("self_attention", create_graph)
    qkv, out, lse = node.saved
    a = node.attrs
    return (dispatch.call("sdpa_packed_backward", grads[0], qkv, out, lse, a["n_head"], a["causal"], a["scale"],
                          dtype=qkv.dtype),)
