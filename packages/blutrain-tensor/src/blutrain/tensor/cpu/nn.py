"""Generic fused kernels of the transformer: norms, bias+GELU, dropout, cross-entropy, attention.

Each forward returns what its backward needs and nothing larger: mean/rstd for LayerNorm, the
log-sum-exp per row for cross-entropy and attention (the probabilities are recomputed in backward,
as flash attention does, rather than stored).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from blutrain.tensor.backend import array_module
from blutrain.tensor.cpu.elementwise import gelu, gelu_backward
from blutrain.tensor.cpu.reduction import logsumexp
from blutrain.tensor.dtype import HALF_NAMES, as_dtype
from blutrain.tensor.errors import ShapeError, TensorTypeError

Array = Any
_quiet = functools.partial(np.errstate, all="ignore")


def _rows(x: Array, k: int) -> Array:
    """``x`` as (rows, features) with the trailing ``k`` dims as features (explicit sizes: 0-size works)."""
    return x.reshape(math.prod(x.shape[: x.ndim - k]), math.prod(x.shape[x.ndim - k:]))


def _row_mean(a: Array) -> Array:
    """Mean of each row as sum / count: with 0 features this is 0/0 = NaN under _quiet, where
    ndarray.mean would warn."""
    return a.sum(axis=1, keepdims=True, dtype=a.dtype) / a.shape[1]


def layer_norm(x: Array, w: Array | None, b: Array | None, eps: float, k: int, out_dtype: Any = None,
               residual: Array | None = None) -> tuple[Array, ...]:
    """(y, mean, rstd); with ``out_dtype`` y is written in that dtype, rounded once from x's (the compiler's
    ``layernorm-cast`` pass: autocast's cast of the output to the GEMM's dtype, folded in).

    With ``residual`` (x's shape, a floating dtype at least as wide as x's) the normalized row is
    s = residual + x in residual's dtype, and the result is (y, mean, rstd, s): the residual add before a
    LayerNorm, which the compiler's ``layernorm-residual`` pass folds in so that the GEMM before it writes
    its bf16 product and nothing else. x widens exactly and the add rounds once, residual first (NumPy keeps
    the first operand's payload when both are NaN), as eager's float32 add of the upcast product does."""
    if residual is not None:
        if residual.shape != x.shape:
            raise ShapeError(f"layer_norm: residual must have x's shape {list(x.shape)}, got "
                             f"{list(residual.shape)}")
        if (residual.dtype.kind != "f" and residual.dtype.name != "bfloat16") or \
                np.dtype(residual.dtype).itemsize < np.dtype(x.dtype).itemsize:
            raise TensorTypeError(f"layer_norm: residual must be a floating dtype at least as wide as x's "
                                  f"{x.dtype.name}, got {residual.dtype.name}")
        s = residual + x.astype(residual.dtype, copy=False)
        return (*layer_norm(s, w, b, eps, k, out_dtype), s)
    xp = array_module(x)
    rows = _rows(x, k)
    with _quiet():
        mean = _row_mean(rows)
        xc = rows - mean
        rstd = 1 / xp.sqrt(_row_mean(xc * xc) + eps)
    y = (xc * rstd).reshape(x.shape)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    if out_dtype is not None:
        y = y.astype(out_dtype)
    lead = x.shape[: x.ndim - k]
    return y, mean.reshape(lead), rstd.reshape(lead)


def layer_norm_backward(grad: Array, x: Array, w: Array | None, mean: Array, rstd: Array, k: int,
                        need_w: bool, need_b: bool, addend: Array | None = None, dx_copy_dtype: Any = None,
                        need_dx_sum: bool = False) -> tuple[Array | None, ...]:
    """dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ ∘ x̂)) with ĝ = dy ∘ w; dw = Σ dy ∘ x̂; db = Σ dy. With ``addend``
    (broadcastable to x) dx + addend: the input's other gradient added as it is produced (the compiler's
    ``layernorm-grad-add`` pass), in x's dtype as a separate add would round it.

    (dx, dw, db), or with ``dx_copy_dtype`` or ``need_dx_sum`` (dx, dw, db, dx in ``dx_copy_dtype``, the column
    sums of dx over its leading dims): the readers of dx that the compiler's ``layernorm-grad-outputs`` pass
    folds in (autocast's cast of the residual gradient for the next GEMM, and the bias gradient of the
    projection that wrote the residual stream). The copy is the stored dx rounded once and the sum the one a
    ``sum`` over dx's leading dims makes, so both are what the separate kernels would give."""
    rows, g = _rows(x, k), _rows(grad, k)
    m, r = mean.reshape(-1, 1), rstd.reshape(-1, 1)
    xhat = (rows - m) * r
    ns = x.shape[x.ndim - k:]
    gw = (g * xhat).sum(axis=0, dtype=x.dtype).reshape(ns) if need_w else None
    gb = g.sum(axis=0, dtype=x.dtype).reshape(ns) if need_b else None
    gxhat = g * w.reshape(1, -1) if w is not None else g
    with _quiet():
        gx = r * (gxhat - _row_mean(gxhat) - xhat * _row_mean(gxhat * xhat))
    gx = gx.reshape(x.shape)
    if addend is not None:
        gx = (addend + gx).astype(x.dtype, copy=False)
    if dx_copy_dtype is None and not need_dx_sum:
        return gx, gw, gb
    copy = gx.astype(dx_copy_dtype) if dx_copy_dtype is not None else None
    with _quiet():
        total = _rows(gx, k).sum(axis=0, dtype=x.dtype).reshape(ns) if need_dx_sum else None
    return gx, gw, gb, copy, total


def rms_norm(x: Array, w: Array | None, eps: float, k: int, out_dtype: Any = None,
             residual: Array | None = None) -> tuple[Array, ...]:
    """(y, rstd) of y = x / sqrt(mean(x²) + eps) · w over the trailing ``k`` dims; with ``out_dtype`` y is
    written in that dtype, rounded once (the compiler's ``layernorm-cast`` pass, as :func:`layer_norm`'s).

    With ``residual`` (x's shape, a floating dtype at least as wide as x's) the normalized row is
    s = residual + x in residual's dtype and the result is (y, rstd, s): a pre-norm block's residual add
    and the next norm in one pass (the compiler's ``layernorm-residual`` pass, as :func:`layer_norm`'s
    ``residual``), the add rounded once, residual first."""
    if residual is not None:
        if residual.shape != x.shape:
            raise ShapeError(f"rms_norm: residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        if (residual.dtype.kind != "f" and residual.dtype.name != "bfloat16") or \
                np.dtype(residual.dtype).itemsize < np.dtype(x.dtype).itemsize:
            raise TensorTypeError(f"rms_norm: residual must be a floating dtype at least as wide as x's "
                                  f"{x.dtype.name}, got {residual.dtype.name}")
        s = residual + x.astype(residual.dtype, copy=False)
        return (*rms_norm(s, w, eps, k, out_dtype), s)
    xp = array_module(x)
    rows = _rows(x, k)
    with _quiet():
        rstd = 1 / xp.sqrt(_row_mean(rows * rows) + eps)
    y = (rows * rstd).reshape(x.shape)
    if w is not None:
        y = y * w
    if out_dtype is not None:
        y = y.astype(out_dtype)
    return y, rstd.reshape(x.shape[: x.ndim - k])


def rms_norm_backward(grad: Array, x: Array, w: Array | None, rstd: Array, k: int,
                      need_w: bool) -> tuple[Array, Array | None]:
    """dx = rstd · (ĝ − x̂ · mean(ĝ ∘ x̂)) with ĝ = dy ∘ w; dw = Σ dy ∘ x̂."""
    rows, g = _rows(x, k), _rows(grad, k)
    r = rstd.reshape(-1, 1)
    xhat = rows * r
    gw = (g * xhat).sum(axis=0, dtype=x.dtype).reshape(x.shape[x.ndim - k:]) if need_w else None
    gxhat = g * w.reshape(1, -1) if w is not None else g
    with _quiet():
        gx = r * (gxhat - xhat * _row_mean(gxhat * xhat))
    return gx.reshape(x.shape), gw


def rope(q: Array, k: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """Rotary position embedding of ``q`` (B, T, H, D) and ``k`` (B, T, H_kv, D) in one call, in the
    rotate-half layout (Hugging Face's Llama): with x₁, x₂ the first and second halves of each head,
    (x₁ cos − x₂ sin, x₂ cos + x₁ sin); ``cos``, ``sin`` (T, D/2) are the angles of each position and
    frequency. Each output has its input's dtype."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rope_backward(grad_q: Array, grad_k: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """The gradients of :func:`rope`'s inputs: each pair rotated back (the transpose of a rotation is the
    rotation by the opposite angle), so backward keeps only the angles, no activation."""
    return _rotate(grad_q, cos, -sin), _rotate(grad_k, cos, -sin)


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    xp = array_module(x)
    half = x.shape[-1] // 2
    c = cos.reshape(cos.shape[0], 1, half)  # (T, 1, D/2): one angle per position and frequency, every head
    s = sin.reshape(sin.shape[0], 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    out = xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype, copy=False)


def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) · up: the gated MLP of Llama (SwiGLU), one pass over both projections."""
    with _quiet():
        return gate / (1 + np.exp(-gate)) * up


def swiglu_backward(grad: Array, gate: Array, up: Array, need_gate: bool,
                    need_up: bool) -> tuple[Array | None, Array | None]:
    """d gate = dy · up · σ(g)(1 + g(1 − σ(g))), d up = dy · silu(g) (σ recomputed from the saved gate)."""
    with _quiet():
        sig = 1 / (1 + np.exp(-gate))
        gg = grad * up * (sig * (1 + gate * (1 - sig))) if need_gate else None
        gu = grad * (gate * sig) if need_up else None
    return gg, gu


def bias_gelu(x: Array, bias: Array, approximate: str) -> Array:
    """GELU(x + bias), ``bias`` (D,) broadcast over the last dim of ``x``."""
    return gelu(x + bias, approximate)


def bias_gelu_backward(grad: Array, x: Array, bias: Array, approximate: str,
                       need_bias: bool) -> tuple[Array, Array | None]:
    """dx = dy · GELU'(x + bias); dbias = Σ dx over every dim but the last (from dx before any rounding)."""
    gx = gelu_backward(grad, x + bias, approximate)
    gb = _rows(gx, 1).sum(axis=0, dtype=gx.dtype) if need_bias else None
    return gx, gb


def dropout(x: Array, p: float, generator: Any) -> tuple[Array, Array]:
    from blutrain.tensor.dtype import float32

    xp = array_module(x)
    keep = generator.uniform(x.shape, float32) >= p
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return xp.where(keep, x * scale, 0).astype(x.dtype, copy=False), keep


def cross_entropy(logits: Array, target: Array, ignore_index: int, label_smoothing: float,
                  reduction: str) -> tuple[Array, Array]:
    xp = array_module(logits)
    lse = logsumexp(logits, (1,), False)
    valid = target != ignore_index
    safe = xp.where(valid, target, 0)
    picked = xp.take_along_axis(logits, safe.reshape(-1, 1).astype(np.int64), axis=1).reshape(-1)
    loss = lse - picked
    if label_smoothing:
        smooth = lse - logits.mean(axis=1, dtype=logits.dtype)
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    loss = xp.where(valid, loss, 0).astype(logits.dtype, copy=False)
    if reduction == "none":
        return loss, lse
    total = loss.sum(dtype=logits.dtype)
    if reduction == "sum":
        return xp.asarray(total), lse
    with _quiet():
        return xp.asarray(total / valid.sum()).astype(logits.dtype), lse


def cross_entropy_backward(grad: Array, logits: Array, target: Array, lse: Array, ignore_index: int,
                           label_smoothing: float, reduction: str) -> Array:
    """dlogits = softmax − (1−ε)·onehot − ε/C, zero on ignored rows, times the upstream grad."""
    xp = array_module(logits)
    n, c = logits.shape
    valid = target != ignore_index
    safe = xp.where(valid, target, 0).astype(np.int64)
    with _quiet():
        g = xp.exp(logits - lse.reshape(-1, 1))
    if label_smoothing:
        g = g - label_smoothing / c
    rows = xp.arange(n)
    g[rows, safe] -= 1 - label_smoothing
    if reduction == "none" or reduction == "sum":
        scale = xp.where(valid, grad, 0).reshape(-1, 1)
    else:
        count = valid.sum()
        with _quiet():
            scale = (xp.where(valid, grad, 0) / count).reshape(-1, 1)
    return (g * scale).astype(logits.dtype, copy=False)


def linear_cross_entropy(x: Array, w: Array, target: Array, ignore_index: int, label_smoothing: float,
                         mean: bool, compute: str, loss_dtype: str, need_x: bool, need_w: bool,
                         chunk_rows: int) -> tuple[Array, Array, Array | None, Array | None]:
    """(loss, grad scale, dx, dw) of cross_entropy(x wᵀ, target) over ``chunk_rows`` rows at a time.

    dx and dw are the gradients for an upstream 1 per row (sum semantics); backward multiplies them by
    its gradient times ``scale`` (1/count of targets for 'mean', 1 for 'sum'). A half ``compute``
    dtype rounds the operands and the two GEMM results the loss reads (logits, their gradient) to it,
    as GEMMs writing that dtype do; everything else accumulates in float32 and is returned in the
    dtypes of x and w.
    """
    xp = array_module(x)
    cd = as_dtype(compute)
    half = cd.name in HALF_NAMES
    acc = np.dtype(np.float32) if half else np.dtype(cd.np)

    def rounded(a: Array) -> Array:
        return a.astype(cd.np).astype(acc) if half else a

    xs = x.astype(cd.np, copy=False).astype(acc, copy=False)
    ws = w.astype(cd.np, copy=False).astype(acc, copy=False)
    n = x.shape[0]
    loss_rows = xp.zeros((n,), acc)
    dx = xp.empty(x.shape, acc) if need_x else None
    dw = xp.zeros(w.shape, acc) if need_w else None
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        logits = rounded(xs[start:stop] @ ws.T)
        t = target[start:stop]
        rows, lse = cross_entropy(logits, t, ignore_index, label_smoothing, "none")
        loss_rows[start:stop] = rows
        if need_x or need_w:
            ones = xp.ones((stop - start,), acc)
            dl = rounded(cross_entropy_backward(ones, logits, t, lse, ignore_index, label_smoothing, "none"))
            if dx is not None:
                dx[start:stop] = dl @ ws
            if dw is not None:
                dw += dl.T @ xs[start:stop]
    total = loss_rows.sum(dtype=acc)
    count = (target != ignore_index).sum()
    with _quiet():
        loss = xp.asarray(total / count if mean else total).astype(as_dtype(loss_dtype).np)
        # a mean over no targets is 0/0: NaN loss and NaN gradients. The scale is NaN rather than 1/0 = inf,
        # so that backward's gradient × scale gives those NaNs without an invalid-value warning (0 × inf)
        scale = xp.asarray((acc.type(1) / count if count else acc.type("nan")) if mean else 1, dtype=acc)
    return (loss, scale, None if dx is None else dx.astype(x.dtype, copy=False),
            None if dw is None else dw.astype(w.dtype, copy=False))


_ABOVE_DIAGONAL: dict[tuple[int, int, int], Array] = {}


def _above_diagonal(xp: Any, t: int, u: int) -> Array:
    """The (t, u) mask of keys a causal query must not see, built once per size and module."""
    key = (id(xp), t, u)
    found = _ABOVE_DIAGONAL.get(key)
    if found is None:
        found = xp.triu(xp.ones((t, u), dtype=bool), 1)
        if len(_ABOVE_DIAGONAL) > 64:
            _ABOVE_DIAGONAL.clear()
        _ABOVE_DIAGONAL[key] = found
    return found


def _scores(q: Array, k: Array, mask: Array | None, causal: bool, scale: float) -> Array:
    xp = array_module(q)
    # the scale on q (T·D products) rather than on the scores (T·T)
    s = xp.matmul(q * xp.asarray(scale, dtype=q.dtype), xp.swapaxes(k, -1, -2))
    if causal:
        xp.copyto(s, -xp.inf, where=_above_diagonal(xp, s.shape[-2], s.shape[-1]))
    elif mask is not None:
        s = xp.where(mask, s, -xp.inf) if mask.dtype == bool else s + mask
    return s


def _query_group(q: Array, k: Array) -> int:
    """Query heads per key/value head: 1, or H / H_kv when k has fewer heads (dim -3) than q (grouped-query
    attention: query head h reads key/value head h // group)."""
    return 1 if q.ndim < 3 or k.shape[-3] == q.shape[-3] else q.shape[-3] // k.shape[-3]


def _grouped(q: Array, k: Array, v: Array, mask: Array | None, group: int) -> tuple[Array, Array, Array, Array | None]:
    """(..., H_kv, group, L, E) queries and (..., H_kv, 1, S, E) keys and values (views; the matmuls broadcast
    the key/value heads over their group, nothing is repeated), the mask broadcast to the grouped scores."""
    xp = array_module(q)
    hkv = k.shape[-3]
    qg = q.reshape(*q.shape[:-3], hkv, group, *q.shape[-2:])
    kg, vg = k[..., None, :, :], v[..., None, :, :]
    if mask is not None:
        scores = (*q.shape[:-1], k.shape[-2])
        mask = xp.broadcast_to(mask, scores).reshape(*scores[:-3], hkv, group, *scores[-2:])
    return qg, kg, vg, mask


def sdpa(q: Array, k: Array, v: Array, mask: Array | None, causal: bool, scale: float) -> tuple[Array, Array]:
    """softmax(q kᵀ·scale + mask) v, returning the output and the row log-sum-exp. k and v may have fewer
    heads (dim -3) than q, a divisor: query head h then attends with key/value head h // (H / H_kv)."""
    group = _query_group(q, k)
    if group > 1:
        out, lse = _attend(*_grouped(q, k, v, mask, group), causal, scale)
        return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])
    return _attend(q, k, v, mask, causal, scale)


def _attend(q: Array, k: Array, v: Array, mask: Array | None, causal: bool, scale: float) -> tuple[Array, Array]:
    """``sdpa`` on arrays whose leading dims broadcast in the matmuls."""
    xp = array_module(q)
    s = _scores(q, k, mask, causal, scale)
    if mask is None:
        # every row sees at least one key (causal: its own position), so its max is finite: the scores are
        # exponentiated once, in place, and the output normalised after the product (T·D divisions, not T·T)
        m = xp.max(s, axis=-1, keepdims=True)
        s -= m
        with _quiet():
            xp.exp(s, out=s)
        total = xp.sum(s, axis=-1, keepdims=True, dtype=s.dtype)
        out = xp.matmul(s, v)
        out /= total
        lse = (xp.log(total) + m)[..., 0]
        return out.astype(q.dtype, copy=False), lse.astype(q.dtype, copy=False)
    lse = logsumexp(s, (s.ndim - 1,), False)
    with _quiet():
        p = xp.exp(s - lse[..., None])
    return xp.matmul(p, v).astype(q.dtype, copy=False), lse.astype(q.dtype, copy=False)


def sdpa_backward(grad: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, mask: Array | None,
                  causal: bool, scale: float) -> tuple[Array, Array, Array]:
    """Flash-attention backward: P is recomputed from the saved log-sum-exp; D = rowsum(dO ∘ O). With fewer
    key/value heads than query heads (see ``sdpa``) dk and dv sum over each key/value head's query group."""
    group = _query_group(q, k)
    if group > 1:
        qg, kg, vg, mg = _grouped(q, k, v, mask, group)
        lead = (*qg.shape[:-2], grad.shape[-2])
        dq, dk, dv = _attend_backward(grad.reshape(*lead, grad.shape[-1]), qg, kg, vg,
                                      out.reshape(*lead, out.shape[-1]), lse.reshape(lead), mg, causal, scale)
        return dq.reshape(q.shape), dk.sum(axis=-3, dtype=dk.dtype), dv.sum(axis=-3, dtype=dv.dtype)
    return _attend_backward(grad, q, k, v, out, lse, mask, causal, scale)


def _attend_backward(grad: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, mask: Array | None,
                     causal: bool, scale: float) -> tuple[Array, Array, Array]:
    """``sdpa_backward`` on arrays whose leading dims broadcast in the matmuls (dk, dv in the scores' batch
    shape)."""
    xp = array_module(q)
    s = _scores(q, k, mask, causal, scale)
    if mask is None:  # no row is wholly masked (see sdpa): P in place of the scores, no NaN to clear
        s -= lse[..., None]
        with _quiet():
            p = xp.exp(s, out=s)
    else:
        with _quiet():
            p = xp.exp(s - lse[..., None])
        p = xp.where(xp.isfinite(s), p, 0)
    dv = xp.matmul(xp.swapaxes(p, -1, -2), grad)
    ds = xp.matmul(grad, xp.swapaxes(v, -1, -2))  # dP, then dS = P ∘ (dP − D) in the same buffer
    ds -= (grad * out).sum(axis=-1, keepdims=True, dtype=q.dtype)
    ds *= p
    dq = xp.matmul(ds, k)
    dq *= scale
    dk = xp.matmul(xp.swapaxes(ds, -1, -2), q)
    dk *= scale
    return dq.astype(q.dtype, copy=False), dk.astype(q.dtype, copy=False), dv.astype(q.dtype, copy=False)


def _heads(x: Array, n_head: int, parts: int) -> list[Array]:
    """The ``parts`` column blocks of a [B, T, parts·C] array as (B, H, T, D) views (head h at columns h·D of
    each block), as ``split`` + ``reshape`` + ``transpose`` would give them."""
    B, T, W = x.shape
    C = W // parts
    xp = array_module(x)
    return [xp.swapaxes(x[:, :, i * C:(i + 1) * C].reshape(B, T, n_head, C // n_head), 1, 2) for i in range(parts)]


def sdpa_packed(qkv: Array, n_head: int, causal: bool, scale: float) -> tuple[Array, Array]:
    """Self-attention over a packed [B, T, 3C] projection (q | k | v): y [B, T, C] and the lse [B, H, T]. The
    same arithmetic as ``sdpa`` on the split heads, so the two paths agree exactly. The heads are copied
    contiguous first: the batched products run faster on them than on the strided views."""
    xp = array_module(qkv)
    q, k, v = (xp.ascontiguousarray(h) for h in _heads(qkv, n_head, 3))
    out, lse = sdpa(q, k, v, None, causal, scale)
    B, T, _ = qkv.shape
    return xp.swapaxes(out, 1, 2).reshape(B, T, -1), lse


def sdpa_packed_backward(grad: Array, qkv: Array, out: Array, lse: Array, n_head: int, causal: bool,
                         scale: float) -> Array:
    """dqkv [B, T, 3C]: the three gradients of ``sdpa_backward`` on the split heads, each written once into its
    block (no zero fill, no sum)."""
    xp = array_module(qkv)
    q, k, v = (xp.ascontiguousarray(h) for h in _heads(qkv, n_head, 3))  # as in sdpa_packed
    g, o = xp.ascontiguousarray(_heads(grad, n_head, 1)[0]), xp.ascontiguousarray(_heads(out, n_head, 1)[0])
    grads = sdpa_backward(g, q, k, v, o, lse, None, causal, scale)
    dqkv = xp.empty(qkv.shape, dtype=grads[0].dtype)
    for part, d in zip(_heads(dqkv, n_head, 3), grads, strict=True):
        part[...] = d
    return dqkv
