"""The neural-network ops a transformer is built from, each one fused kernel forward and backward.

LayerNorm keeps mean and rstd for backward instead of the normalized tensor; cross-entropy keeps the
log-sum-exp per row instead of the softmax; attention keeps the log-sum-exp per query instead of
the T×S probability matrix; bias+GELU keeps its input and bias, not their sum. Those choices set
the memory a training step needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from blutrain.tensor import dispatch
from blutrain.tensor.autocast import lower, widen
from blutrain.tensor.autocast import state as autocast_state
from blutrain.tensor.backend import Generator
from blutrain.tensor.base import TensorBase
from blutrain.tensor.checks import check_class_targets
from blutrain.tensor.dtype import bool_, float32, from_numpy_dtype
from blutrain.tensor.errors import (
    DeviceMismatchError,
    ShapeError,
    TensorTypeError,
    TensorValueError,
)
from blutrain.tensor.ops.indexing import _check_bounds, _index_tensor

if TYPE_CHECKING:
    from blutrain.tensor.tensor import Tensor

_grad_mode = dispatch.grad_mode
_autocast = autocast_state
_kernel = dispatch.kernel


def _needs_grad(*ts: Tensor | None) -> bool:
    return _grad_mode.enabled and dispatch.recorder is not None and any(t is not None and t._rg for t in ts)


def _same(op: str, x: Tensor, name: str, other: Tensor | None, shape: tuple[int, ...] | None = None,
          x_name: str = "input") -> None:
    if other is None:
        return
    if not isinstance(other, TensorBase):
        raise TensorTypeError(f"{op}: {name} must be a Tensor or None, got {type(other).__name__}")
    if other.device is not x.device:
        raise DeviceMismatchError(f"{op}: {name} is on {other.device}, {x_name} on {x.device}")
    if other.dtype is not x.dtype:
        raise TensorTypeError(f"{op}: {name} has dtype {other.dtype.name}, {x_name} has {x.dtype.name}")
    if shape is not None and other.shape != shape:
        raise ShapeError(f"{op}: {name} must have shape {list(shape)}, got {list(other.shape)}")


def _statistic(data: Any, like: Tensor) -> Tensor:
    """Wrap a per-row statistic a forward kernel returned for backward; its dtype is the kernel's
    choice (float32 for half inputs, as PyTorch keeps them)."""
    return like._make(data, from_numpy_dtype(data.dtype), like.device)


def _floating(op: str, x: Tensor, name: str = "input") -> None:
    if not isinstance(x, TensorBase):
        raise TensorTypeError(f"{op}: {name} must be a Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating:
        raise TensorTypeError(f"{op}: {name} must be floating, got dtype {x.dtype.name}")


def layer_norm(x: Tensor, normalized_shape: Sequence[int] | int, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Normalize over the trailing ``normalized_shape`` dims, then scale and shift."""
    if _autocast.dtype is not None:
        x, weight, bias = widen(x), widen(weight), widen(bias)
    _floating("layer_norm", x)
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(ns)
    if k == 0 or x.shape[x.ndim - k:] != ns:
        raise ShapeError(f"layer_norm: normalized_shape {list(ns)} does not match the trailing dims of input "
                         f"shape {list(x.shape)}")
    _same("layer_norm", x, "weight", weight, ns)
    _same("layer_norm", x, "bias", bias, ns)
    out, mean, rstd = _kernel("layer_norm", x.device.type, x.dtype)(
        x.array, None if weight is None else weight.array, None if bias is None else bias.array, eps, k)
    res = x._make(out, x.dtype, x.device)
    if _needs_grad(x, weight, bias):
        m, r = _statistic(mean, x), _statistic(rstd, x)
        dispatch.recorder("layer_norm", (x, weight, bias), res, {"mean": m, "rstd": r, "k": k})  # type: ignore[misc]
    return res


def rms_norm(x: Tensor, normalized_shape: Sequence[int] | int, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the trailing dims (eps defaults to the dtype's eps)."""
    if _autocast.dtype is not None:
        x, weight = widen(x), widen(weight)
    _floating("rms_norm", x)
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(ns)
    if k == 0 or x.shape[x.ndim - k:] != ns:
        raise ShapeError(f"rms_norm: normalized_shape {list(ns)} does not match the trailing dims of input "
                         f"shape {list(x.shape)}")
    _same("rms_norm", x, "weight", weight, ns)
    if eps is None:
        import numpy as np

        eps = float(np.finfo(x.dtype.np).eps) if x.dtype.name != "bfloat16" else 0.0078125
    out, rstd = _kernel("rms_norm", x.device.type, x.dtype)(
        x.array, None if weight is None else weight.array, eps, k)
    res = x._make(out, x.dtype, x.device)
    if _needs_grad(x, weight):
        r = _statistic(rstd, x)
        dispatch.recorder("rms_norm", (x, weight), res, {"rstd": r, "k": k})  # type: ignore[misc]
    return res


def bias_gelu(input: Tensor, bias: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(input + bias)`` with ``bias`` (D,) over the last dim: the bias epilogue of the GEMM before it
    (GPT-2's c_fc) fused with the activation, one kernel each way; backward keeps input and bias, not the sum.

    Under autocast it runs in the region's dtype, as ``linear(..., bias)`` followed by ``gelu`` would.
    """
    if _autocast.dtype is not None:
        input, bias = lower(input), lower(bias)
    _floating("bias_gelu", input)
    if approximate not in ("none", "tanh"):
        raise TensorValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if input.ndim == 0:
        raise ShapeError("bias_gelu: input must have at least 1 dim (the bias runs over the last), got a 0-d tensor")
    if not isinstance(bias, TensorBase):
        raise TensorTypeError(f"bias_gelu: bias must be a Tensor, got {type(bias).__name__}")
    _same("bias_gelu", input, "bias", bias, (input.shape[-1],))
    out = _kernel("bias_gelu", input.device.type, input.dtype)(input.array, bias.array, approximate)
    res = input._make(out, input.dtype, input.device)
    if _needs_grad(input, bias):
        dispatch.recorder("bias_gelu", (input, bias), res, {"approximate": approximate})  # type: ignore[misc]
    return res


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embeddings applied to queries and keys in one kernel: ``q`` (B, T, H, D) and ``k``
    (B, T, H_kv, D), the layout their projections write, D even; ``cos``, ``sin`` (T, D/2) the angles
    of each position and frequency (q's dtype, or float32 for half q and k). Rotate-half layout: each
    head's first and second halves x₁, x₂ become (x₁ cos − x₂ sin, x₂ cos + x₁ sin), as Hugging Face's
    Llama. Backward rotates the gradients back and keeps only the angles."""
    _floating("rope", q, "q")
    _floating("rope", k, "k")
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[3] % 2:
        raise ShapeError(f"rope: q must be (B, T, H, D) and k (B, T, H_kv, D) with D even, got {list(q.shape)} and "
                         f"{list(k.shape)}")
    _same("rope", q, "k", k, None, "q")
    angles = (q.shape[1], q.shape[3] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, TensorBase) or t.device is not q.device or t.shape != angles:
            got = f"{list(t.shape)} on {t.device}" if isinstance(t, TensorBase) else type(t).__name__
            raise ShapeError(f"rope: {name} must be a (T, D/2) = {list(angles)} tensor on {q.device}, got {got}")
        if t.dtype is not q.dtype and not (t.dtype is float32 and q.dtype.itemsize == 2):
            raise TensorTypeError(f"rope: {name} must have q's dtype {q.dtype.name} (or float32 for half q), got "
                                  f"{t.dtype.name}")
    qd, kd = _kernel("rope", q.device.type, q.dtype)(q.array, k.array, cos.array, sin.array)
    out = (q._make(qd, q.dtype, q.device), k._make(kd, k.dtype, k.device))
    if _needs_grad(q, k):
        dispatch.recorder("rope", (q, k), out, {"cos": cos.detach(), "sin": sin.detach()})  # type: ignore[misc]
    return out


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` in one kernel each way: Llama's gated MLP between its gate/up and down
    projections. Backward keeps ``gate`` and ``up`` (not the product). Under autocast it runs in the
    region's dtype, as the projections before it do."""
    if _autocast.dtype is not None:
        gate, up = lower(gate), lower(up)
    _floating("swiglu", gate, "gate")
    _same("swiglu", gate, "up", up, tuple(gate.shape), "gate")
    out = gate._make(_kernel("swiglu", gate.device.type, gate.dtype)(gate.array, up.array), gate.dtype, gate.device)
    if _needs_grad(gate, up):
        dispatch.recorder("swiglu", (gate, up), out, {})  # type: ignore[misc]
    return out


def dropout(x: Tensor, p: float = 0.5, training: bool = True, generator: Generator | None = None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (identity when not training)."""
    _floating("dropout", x)
    if not 0.0 <= p <= 1.0:
        raise TensorValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    gen = generator if generator is not None else x.device.backend.generator(x.device.index)
    out, mask = _kernel("dropout", x.device.type, x.dtype)(x.array, float(p), gen)
    res = x._make(out, x.dtype, x.device)
    if _needs_grad(x):
        dispatch.recorder("dropout", (x,), res, {"mask": x._make(mask, bool_, x.device), "p": p})  # type: ignore[misc]
    return res


def embedding(input: Tensor, weight: Tensor) -> Tensor:
    """Rows of ``weight`` (num_embeddings, dim) picked by the integer ``input`` (any shape)."""
    _index_tensor(input, weight, "embedding", "input", "weight")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-D (num_embeddings, dim), got shape {list(weight.shape)}")
    _check_bounds("embedding", input, weight.shape[0], 0, "weight", "input")
    out = weight._make(_kernel("embedding", weight.device.type, weight.dtype)(weight.array, input.array),
                       weight.dtype, weight.device)
    if _needs_grad(weight):
        dispatch.recorder("embedding", (weight,), out, {"index": input, "num_embeddings": weight.shape[0]})  # type: ignore[misc]
    return out


def _check_class_target(op: str, input: Tensor, target: Tensor, label_smoothing: float) -> None:
    """The checks every softmax cross-entropy makes of its targets and smoothing."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise TensorValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not isinstance(target, TensorBase) or target.dtype.is_floating or target.dtype is bool_:
        got = target.dtype.name if isinstance(target, TensorBase) else type(target).__name__
        raise TensorTypeError(f"{op}: target must be an integer Tensor of class indices, got {got}")
    if target.device is not input.device:
        raise DeviceMismatchError(f"{op}: target is on {target.device}, input on {input.device}")


def cross_entropy(input: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Softmax cross-entropy of logits ``input`` (N, C) or (N, C, d...) against class indices.

    ``reduction='mean'`` averages over targets that are not ``ignore_index``; label smoothing mixes
    the one-hot target with the uniform distribution, as in PyTorch.
    """
    if _autocast.dtype is not None:
        input = widen(input)
    _floating("cross_entropy", input)
    if reduction not in ("mean", "sum", "none"):
        raise TensorValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    _check_class_target("cross_entropy", input, target, label_smoothing)
    extra: tuple[int, ...] = ()
    if input.ndim == 1:
        logits, tgt = input.unsqueeze(0), target.reshape(1)
    else:
        extra = input.shape[2:]
        if target.shape != (input.shape[0], *extra):
            raise ShapeError(f"cross_entropy: target shape {list(target.shape)} does not match input "
                             f"{list(input.shape)} (expected {[input.shape[0], *extra]})")
        logits = input.movedim(1, -1).reshape(-1, input.shape[1]) if extra else input
        tgt = target.reshape(-1)
    num_classes = logits.shape[1]
    if tgt.device.type == "cpu":  # elsewhere the debug mode checks the targets
        check_class_targets("cross_entropy", tgt.array, num_classes, ignore_index)
    loss, lse = _kernel("cross_entropy", input.device.type, input.dtype)(
        logits.array, tgt.array, ignore_index, float(label_smoothing), reduction)
    res = input._make(loss, input.dtype, input.device)
    if _needs_grad(logits):
        dispatch.recorder("cross_entropy", (logits,), res, {  # type: ignore[misc]
            "target": tgt, "lse": _statistic(lse, input), "ignore_index": ignore_index,
            "label_smoothing": float(label_smoothing), "reduction": reduction})
    if reduction == "none":
        if input.ndim == 1:
            return res.reshape(())
        if extra:
            return res.reshape((input.shape[0], *extra))
    return res


# Bytes of logits one chunk of ``linear_cross_entropy`` should hold (its logits and their gradient, each):
# small next to GPT-2's full [B·T, V] logits (3 GiB in float32 at 16×1024×50304), large enough that
# the chunk's GEMMs keep the tensor cores busy. A target, not a bound: see default_chunk_rows.
LOGITS_CHUNK_BYTES = 256 * 2**20


def default_chunk_rows(n_rows: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk of ``linear_cross_entropy`` when no ``chunk_size`` is given: the rows split into
    equal chunks, as many as :data:`LOGITS_CHUNK_BYTES` of logits per chunk gives, rounded to the nearest
    count. Every chunk, a short last one included, reads and writes the whole float32 weight-gradient
    accumulator ([V, C], 154 MB for GPT-2) in its dW GEMM: at B·T = 16384 the budget's 2668 rows would
    make six chunks and a seventh of 376 rows that pays that pass for 2% of the rows; six chunks of 2731
    rows do the same work without it. So the budget is approximate: a
    chunk holds at most 1.5 times it (one chunk up to 1.5 budgets of rows), 1 + 1/(2·chunks) times it
    in general, plus a row."""
    budget = max(1, LOGITS_CHUNK_BYTES // max(1, vocab * itemsize))
    chunks = max(1, (n_rows + budget // 2) // budget)  # round half up: n_rows / budget to the nearest count
    return max(1, -(-n_rows // chunks))


def linear_cross_entropy(input: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         chunk_size: int | None = None) -> Tensor:
    """``cross_entropy(linear(input, weight), target)`` without the logits tensor: a language model's
    head and loss in one op, for training at large vocabularies.

    ``input`` (..., C) and ``weight`` (V, C) — the tied token embedding, say — give V logits per row;
    the rows are processed ``chunk_size`` at a time (exactly; default: equal chunks of about
    :data:`LOGITS_CHUNK_BYTES` of logits each, see :func:`default_chunk_rows`): each chunk's logits,
    its loss and its logit gradient live only while that chunk runs, and the input and weight
    gradients are computed in the forward when either needs a gradient (kept until backward, scaled
    there by the upstream gradient). Memory:
    two chunks of logits and the two gradients instead of the [N, V] logits and their gradient.
    Under autocast the GEMMs run in the region's dtype (logits and their gradient in it, as the
    separate ops do), the loss in float32, and the gradients are accumulated in float32 and
    returned in the dtype of ``input`` and ``weight``, with no rounding to the half dtype between.
    ``reduction`` is 'mean' (over targets that are not ``ignore_index``) or 'sum'.
    """
    _floating("linear_cross_entropy", input)
    _floating("linear_cross_entropy", weight, "weight")
    if weight.device is not input.device:
        raise DeviceMismatchError(f"linear_cross_entropy: weight is on {weight.device}, input on {input.device}")
    if weight.dtype is not input.dtype:
        raise TensorTypeError(f"linear_cross_entropy: weight has dtype {weight.dtype.name}, input has "
                              f"{input.dtype.name}; expected the same dtype")
    if weight.ndim != 2 or input.ndim == 0 or input.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear_cross_entropy: input of shape {list(input.shape)} does not fit weight of "
                         f"shape {list(weight.shape)} (expected input[..., {weight.shape[-1] if weight.ndim else '?'}] "
                         "and a 2-D weight (V, C))")
    if reduction not in ("mean", "sum"):
        raise TensorValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r} "
                               "(per-row losses need the logits: use linear + cross_entropy)")
    _check_class_target("linear_cross_entropy", input, target, label_smoothing)
    if target.shape != input.shape[:-1]:
        raise ShapeError(f"linear_cross_entropy: target shape {list(target.shape)} does not match input "
                         f"{list(input.shape)} (expected {list(input.shape[:-1])})")
    n_rows = math.prod(input.shape[:-1])
    # the arrays reshaped, not the tensors: the op records itself against input and target as given
    rows = input.array.reshape(n_rows, input.shape[-1])
    tgt = target.array.reshape(n_rows)
    vocab = weight.shape[0]
    compute = _autocast.dtype or input.dtype
    if chunk_size is None:
        chunk_size = default_chunk_rows(n_rows, vocab, compute.itemsize)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise TensorValueError(f"linear_cross_entropy: chunk_size must be a positive int, got {chunk_size!r}")
    if target.device.type == "cpu":  # elsewhere the debug mode checks the targets
        check_class_targets("linear_cross_entropy", tgt, vocab, ignore_index)
    loss_dtype = float32 if _autocast.dtype is not None else input.dtype
    need_x, need_w = _needs_grad(input), _needs_grad(weight)
    loss, scale, dx, dw = _kernel("linear_cross_entropy", input.device.type, input.dtype)(
        rows, weight.array, tgt, ignore_index, float(label_smoothing), reduction == "mean",
        compute.name, loss_dtype.name, need_x, need_w, min(chunk_size, max(1, n_rows)))
    res = input._make(loss, loss_dtype, input.device)
    if need_x or need_w:
        dispatch.recorder("linear_cross_entropy", (input, weight), res, {  # type: ignore[misc]
            "scale": _statistic(scale, input),
            "dx": None if dx is None else input._make(dx.reshape(input.shape), input.dtype, input.device),
            "dw": None if dw is None else weight._make(dw, weight.dtype, weight.device)})
    return res


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """softmax(q kᵀ · scale + mask) v over (..., L, E) queries and (..., S, E) keys.

    A bool ``attn_mask`` marks positions that take part (True) as in PyTorch; a float mask is added
    to the scores. ``is_causal`` lets query i see keys 0..i (top-left aligned). ``enable_gqa`` allows
    grouped-query attention as in PyTorch: key and value may have H_kv heads (dim -3), a divisor of query's
    H, and query head h reads key/value head h // (H / H_kv); the shared heads are never repeated in memory,
    and the gradients of key and value (summed over each head's query group) have their own shapes.
    """
    if _autocast.dtype is not None:
        query, key, value = lower(query), lower(key), lower(value)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _floating("scaled_dot_product_attention", t, name)
        if t.ndim < 2:
            raise ShapeError(f"scaled_dot_product_attention: {name} needs at least 2 dims, got {list(t.shape)}")
    _same("scaled_dot_product_attention", query, "key", key, x_name="query")
    _same("scaled_dot_product_attention", query, "value", value, x_name="query")
    if enable_gqa:
        _check_gqa_heads(query, key, value)
    if key.shape[-1] != query.shape[-1] or key.shape[-2] != value.shape[-2] or key.shape[:-3] != query.shape[:-3] \
            or value.shape[:-3] != query.shape[:-3] or key.shape[-3:-2] != value.shape[-3:-2] \
            or (not enable_gqa and key.shape[:-2] != query.shape[:-2]):
        raise ShapeError(f"scaled_dot_product_attention: query {list(query.shape)}, key {list(key.shape)} and "
                         f"value {list(value.shape)} do not fit (..., L, E), (..., S, E), (..., S, Ev)"
                         + _gqa_hint(query, key, value, enable_gqa))
    if dropout_p != 0.0:
        raise TensorValueError("scaled_dot_product_attention: dropout_p must be 0.0; attention dropout is not "
                               f"supported (got {dropout_p})")
    if attn_mask is not None and is_causal:
        raise TensorValueError("scaled_dot_product_attention: give either attn_mask or is_causal, not both")
    mask_data: Any = None
    if attn_mask is not None:
        if not isinstance(attn_mask, TensorBase) or attn_mask.device is not query.device:
            raise TensorTypeError("scaled_dot_product_attention: attn_mask must be a Tensor on the query's device")
        from blutrain.tensor.ops.elementwise import broadcast_shapes

        scores_shape = (*query.shape[:-1], key.shape[-2])
        if broadcast_shapes(scores_shape, attn_mask.shape, "scaled_dot_product_attention") != scores_shape:
            raise ShapeError(f"scaled_dot_product_attention: attn_mask {list(attn_mask.shape)} does not broadcast "
                             f"to the scores' shape {list(scores_shape)}")
        mask_data = attn_mask.array if attn_mask.dtype is bool_ else attn_mask.array.astype(query.dtype.np)
    sc = float(scale) if scale is not None else query.shape[-1] ** -0.5
    out, lse = _kernel("sdpa", query.device.type, query.dtype)(query.array, key.array, value.array, mask_data,
                                                                bool(is_causal), sc)
    res = query._make(out, query.dtype, query.device)
    if _needs_grad(query, key, value):
        dispatch.recorder("sdpa", (query, key, value), res, {  # type: ignore[misc]
            "lse": _statistic(lse, query), "mask": mask_data, "causal": bool(is_causal),
            "scale": sc})
    return res


def _check_gqa_heads(query: Tensor, key: Tensor, value: Tensor) -> None:
    """With enable_gqa: key and value have the same head count (dim -3), a divisor of query's."""
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ShapeError(f"scaled_dot_product_attention: enable_gqa needs query, key and value of the same rank "
                         f"with heads at dim -3, got query {list(query.shape)}, key {list(key.shape)} and value "
                         f"{list(value.shape)}")
    h, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk != hv or (h % hk if hk else h):
        raise ShapeError(f"scaled_dot_product_attention: with enable_gqa key and value need the same number of "
                         f"heads (dim -3), a divisor of query's {h}; got key {hk} and value {hv} heads")


def _gqa_hint(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> str:
    """The advice for shapes that differ only in a head count that grouped-query attention accepts."""
    if enable_gqa or query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        return ""
    hk = key.shape[-3]
    fits = hk == value.shape[-3] and hk > 0 and query.shape[-3] % hk == 0 \
        and key.shape[:-3] == query.shape[:-3] == value.shape[:-3]
    return "; for key/value heads shared by groups of query heads pass enable_gqa=True" if fits else ""


def self_attention(qkv: Tensor, n_head: int, is_causal: bool = False, scale: float | None = None) -> Tensor:
    """Multi-head self-attention over a packed projection: ``qkv`` (B, T, 3C) holds q, k and v side by side
    (head h at columns h·D of each, D = C / n_head, as GPT-2's ``c_attn`` makes them); the result is (B, T, C),
    heads side by side again. One op each way: the same values as ``split`` + per-head
    ``scaled_dot_product_attention`` + merging the heads, without materialising the transposed heads, and the
    backward writes the (B, T, 3C) gradient in one buffer, in ``qkv``'s dtype. Keeps ``qkv``, the output and
    the per-query log-sum-exp for backward. Under autocast it runs in the region's dtype, like attention.
    """
    if _autocast.dtype is not None:
        qkv = lower(qkv)
    _floating("self_attention", qkv, "qkv")
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head <= 0:
        raise TensorValueError(f"self_attention: n_head must be a positive int, got {n_head!r}")
    if qkv.ndim != 3 or qkv.shape[2] % (3 * n_head):
        raise ShapeError(f"self_attention: qkv must be (B, T, 3·C) with C a multiple of n_head ({n_head}), "
                         f"got {list(qkv.shape)}")
    sc = float(scale) if scale is not None else (qkv.shape[2] // (3 * n_head)) ** -0.5
    out, lse = _kernel("sdpa_packed", qkv.device.type, qkv.dtype)(qkv.array, n_head, bool(is_causal), sc)
    res = qkv._make(out, qkv.dtype, qkv.device)
    if _needs_grad(qkv):
        dispatch.recorder("sdpa_packed", (qkv,), res, {  # type: ignore[misc]
            "lse": _statistic(lse, qkv), "n_head": n_head, "causal": bool(is_causal), "scale": sc})
    return res
