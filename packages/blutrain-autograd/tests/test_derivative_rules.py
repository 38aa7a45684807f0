"""Every derivative rule is right: float64 finite differences, and float32 against float64.

Each rule of ``blutrain.autograd.RULES`` has a case below: a function of some float inputs that
goes through the rule, and hypothesis-drawn shapes for the inputs. The loss is Σ out ∘ w for a
random w. In float64 the analytic gradient of every input must match central differences; in float32
(inputs rounded to float32 first) it must match the float64 analytic gradient to 1e-5, norm-wise
(see ``assert_close``).
Inputs of non-smooth ops are kept away from their kinks, so the finite differences are meaningful.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.autograd import RULES, checkpoint, no_grad
from blutrain.tensor import Tensor

Fn = Callable[..., Tensor]
Drawn = tuple[list[np.ndarray], Fn]


@dataclass(frozen=True)
class Case:
    draw: Callable[[st.DataObject, np.random.Generator], Drawn]
    step: float = 1e-6  # finite-difference step


CASES: dict[str, Case] = {}


def case(*names: str, step: float = 1e-6) -> Callable[[Callable[..., Drawn]], Callable[..., Drawn]]:
    def register(fn: Callable[..., Drawn]) -> Callable[..., Drawn]:
        for name in names:
            CASES[name] = Case(fn, step)
        return fn

    return register


def shapes(min_ndim: int = 0, max_ndim: int = 3, max_side: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(1, max_side), min_size=min_ndim, max_size=max_ndim).map(tuple)


def broadcastable(data: st.DataObject, shape: tuple[int, ...]) -> tuple[int, ...]:
    drop = data.draw(st.integers(0, len(shape)))
    return tuple(1 if data.draw(st.booleans()) else s for s in shape[drop:])


def away_from(rng: np.random.Generator, shape: tuple[int, ...], points: float = 0.0, low: float = 0.1,
              high: float = 2.0) -> np.ndarray:
    """Values at distance [low, high] from ``points``, either side."""
    mag = rng.uniform(low, high, size=shape)
    return np.where(rng.random(shape) < 0.5, points - mag, points + mag)


def distinct(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values at least 0.05 apart, so max/min picks one element robustly."""
    n = math.prod(shape)
    return (rng.permutation(n) * 0.1 - n * 0.05 + rng.uniform(-0.02, 0.02, n)).reshape(shape)


# -- views and joins ---------------------------------------------------------------------------------
@case("view")
def _view(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    return [rng.standard_normal(shape)], lambda x: (x * 1.0).reshape(-1).unsqueeze(0).squeeze(0) * 2


@case("permute")
def _permute(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(2, 3))
    return [rng.standard_normal(shape)], lambda x: x.transpose(0, -1).mT.permute(*reversed(range(x.ndim))) * 3


@case("expand")
def _expand(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    target = data.draw(shapes(1, 3))
    shape = broadcastable(data, target)
    return [rng.standard_normal(shape)], lambda x: x.expand(target) * 2


@case("slice")
def _slice(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(2, 3, max_side=5))
    return [rng.standard_normal(shape)], lambda x: x[1:, ::2] * 2 + x.select(0, 0).sum() + x.narrow(1, 0, 1).sum()


@case("cat")
def _cat(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    d = data.draw(st.integers(0, len(shape) - 1))
    other = tuple(data.draw(st.integers(1, 3)) if i == d else s for i, s in enumerate(shape))
    return [rng.standard_normal(shape), rng.standard_normal(other)], lambda a, b: bt.cat([a, b * 2], d)


# -- reductions --------------------------------------------------------------------------------------
def draw_dim(data: st.DataObject, ndim: int) -> int | tuple[int, ...] | None:
    if ndim == 0 or data.draw(st.booleans()):
        return None
    return tuple(data.draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True)))


@case("sum")
def _sum(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    dim, keepdim = draw_dim(data, len(shape)), data.draw(st.booleans())
    return [rng.standard_normal(shape)], lambda x: x.sum(dim, keepdim)


@case("mean")
def _mean(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    dim, keepdim = draw_dim(data, len(shape)), data.draw(st.booleans())
    return [rng.standard_normal(shape)], lambda x: x.mean(dim, keepdim)


@case("amax", "amin")
def _amax(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    dim, keepdim = draw_dim(data, len(shape)), data.draw(st.booleans())
    return [distinct(rng, shape)], lambda x: bt.amax(x, dim, keepdim) * 2 + bt.amin(x, dim, keepdim)


@case("max_dim", "min_dim")
def _max_dim(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdim = data.draw(st.booleans())
    return [distinct(rng, shape)], lambda x: x.max(dim, keepdim).values * 2 + x.min(dim, keepdim).values


@case("var")
def _var(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    dim = draw_dim(data, len(shape))
    correction = data.draw(st.sampled_from((0, 1)))
    if correction and math.prod(shape) == 1:
        correction = 0
    if correction and dim is not None and math.prod(shape[d] for d in dim) == 1:
        correction = 0
    return [rng.standard_normal(shape)], lambda x: x.var(dim, correction=correction)


@case("norm")
def _norm(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    dim, p = draw_dim(data, len(shape)), data.draw(st.sampled_from((1.0, 2.0, 3.0, float("inf"))))
    return [distinct(rng, shape) + 0.025], lambda x: x.norm(p, dim)


@case("logsumexp")
def _logsumexp(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    dim, keepdim = draw_dim(data, len(shape)) or 0, data.draw(st.booleans())
    return [rng.standard_normal(shape)], lambda x: x.logsumexp(dim, keepdim=keepdim)


@case("softmax", "log_softmax")
def _softmax(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    return [rng.standard_normal(shape)], lambda x: bt.softmax(x, dim) * 3 + bt.log_softmax(x, dim)


# -- indexing ----------------------------------------------------------------------------------------
@case("index")
def _index(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    idx = bt.tensor(rng.integers(-shape[0], shape[0], size=data.draw(st.integers(1, 6))))
    mask = bt.tensor(rng.random(shape) < 0.5)
    return [rng.standard_normal(shape)], lambda x: bt.cat([x[idx].reshape(-1), x[mask]])


@case("index_select")
def _index_select(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    d = data.draw(st.integers(0, len(shape) - 1))
    idx = bt.tensor(rng.integers(0, shape[d], size=data.draw(st.integers(0, 6))))
    return [rng.standard_normal(shape)], lambda x: bt.index_select(x, d, idx)


def _index_along_a_dim(data: st.DataObject, rng: np.random.Generator) -> tuple[tuple[int, ...], int, bt.Tensor]:
    """(shape, dim d, index): an index of the shape's rank, any length along d and the shape's size elsewhere, with
    values in range along d (what gather reads and scatter_add writes through)."""
    shape = data.draw(shapes(1, 3))
    d = data.draw(st.integers(0, len(shape) - 1))
    ishape = tuple(data.draw(st.integers(1, 4)) if i == d else s for i, s in enumerate(shape))
    return shape, d, bt.tensor(rng.integers(0, shape[d], size=ishape))


@case("gather")
def _gather(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape, d, idx = _index_along_a_dim(data, rng)
    return [rng.standard_normal(shape)], lambda x: bt.gather(x, d, idx)


@case("scatter_add")
def _scatter_add(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape, d, idx = _index_along_a_dim(data, rng)
    return [rng.standard_normal(shape), rng.standard_normal(idx.shape)], lambda x, s: bt.scatter_add(x, d, idx, s)


@case("index_add")
def _index_add(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    d = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(1, 5))
    idx = bt.tensor(rng.integers(0, shape[d], size=k))
    src = tuple(k if i == d else s for i, s in enumerate(shape))
    return [rng.standard_normal(shape), rng.standard_normal(src)], lambda x, s: bt.index_add(x, d, idx, s)


@case("tril", "triu")
def _tri(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(2, 3))
    k = data.draw(st.integers(-2, 2))
    return [rng.standard_normal(shape)], lambda x: bt.tril(x, k) * 2 + bt.triu(x, k)


# -- elementwise -------------------------------------------------------------------------------------
def binary_case(fn: Fn, a_values: Callable[..., np.ndarray] | None = None,
                b_values: Callable[..., np.ndarray] | None = None) -> Callable[..., Drawn]:
    def draw(data: st.DataObject, rng: np.random.Generator) -> Drawn:
        shape = data.draw(shapes())
        sa, sb = broadcastable(data, shape), broadcastable(data, shape)
        a = a_values(rng, sa) if a_values else rng.standard_normal(sa)
        b = b_values(rng, sb) if b_values else rng.standard_normal(sb)
        if data.draw(st.integers(0, 3)) == 0:  # one operand a Python scalar
            scalar = float(b.reshape(-1)[0]) if b.size else 1.5
            return [a], lambda x: fn(x, scalar)
        return [a, b], fn

    return draw


def positive(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.3, 2.0, size=shape)


def nonzero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return away_from(rng, shape, low=0.3)


case("add")(binary_case(lambda a, b: a + b))
case("sub")(binary_case(lambda a, b: a - b + (2.0 - a)))
case("mul")(binary_case(lambda a, b: a * b))
case("div")(binary_case(lambda a, b: a / b + 1.0 / b, nonzero, nonzero))
case("pow")(binary_case(lambda a, b: a**b + 2.0**b, positive, None))


@case("maximum", "minimum")
def _maximum(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    a = distinct(rng, shape)
    b = a + away_from(rng, shape, low=0.01, high=0.04)  # never tied with a
    return [a, b], lambda x, y: bt.maximum(x, y) * 2 + bt.minimum(x, y)


@case("floor_divide", "remainder")
def _floor_divide(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    b = nonzero(rng, shape)
    q = rng.integers(-3, 4, size=shape) + rng.uniform(0.2, 0.8, size=shape)  # a/b not near an integer
    return [q * b, b], lambda a, d: a // d + a % d * 2


def unary_case(fn: Fn, values: Callable[..., np.ndarray] | None = None) -> Callable[..., Drawn]:
    def draw(data: st.DataObject, rng: np.random.Generator) -> Drawn:
        shape = data.draw(shapes())
        return [values(rng, shape) if values else rng.standard_normal(shape)], fn

    return draw


case("neg")(unary_case(lambda x: -x))
case("exp")(unary_case(bt.exp))
case("expm1")(unary_case(bt.expm1))
case("log")(unary_case(bt.log, positive))
case("log1p")(unary_case(bt.log1p, positive))
case("sqrt")(unary_case(bt.sqrt, positive))
case("rsqrt")(unary_case(bt.rsqrt, positive))
case("tanh")(unary_case(bt.tanh))
case("sigmoid")(unary_case(bt.sigmoid))
case("sin")(unary_case(bt.sin))
case("cos")(unary_case(bt.cos))
case("abs")(unary_case(bt.abs, nonzero))
case("sign")(unary_case(lambda x: bt.sign(x) * 3 + x, nonzero))
case("relu")(unary_case(bt.relu, nonzero))
case("silu")(unary_case(bt.silu))
case("erf")(unary_case(bt.erf))
case("gelu")(unary_case(lambda x: bt.gelu(x) + bt.gelu(x, approximate="tanh") * 2))
case("copy")(unary_case(lambda x: x.t().clone() if x.ndim == 2 else x.clone()))


@case("where")
def _where(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    cond = bt.tensor(rng.random(broadcastable(data, shape)) < 0.5)
    a, b = rng.standard_normal(broadcastable(data, shape)), rng.standard_normal(shape)
    return [a, b], lambda x, y: bt.where(cond, x, y) + x.masked_fill(bt.tensor(True), 0.5)


@case("clamp")
def _clamp(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    # bounds at -0.5 and 0.5; values at least 0.05 from either
    values = np.where(rng.random(shape) < 0.5, away_from(rng, shape, -0.5, 0.05, 0.3),
                      away_from(rng, shape, 0.5, 0.05, 0.3))
    return [values], lambda x: bt.clamp(x, -0.5, 0.5) * 2 + bt.clamp(x, min=-0.5) + bt.clamp(x, max=0.5)


@case("cast", step=2.0**-10)
def _cast(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    # values and step on a 2^-10 grid: x ± step is exact in float32, so the linear loss through the
    # cast has exact finite differences
    shape = data.draw(shapes())
    values = rng.integers(-2048, 2048, size=shape) / 1024.0
    def fn(x: Tensor) -> Tensor:  # through a cast each way; the loss is float64 either way
        if x.dtype is bt.float64:
            return (x.to(dtype=bt.float32) * 3).to(dtype=bt.float64)
        return x.to(dtype=bt.float64) * 3

    return [values], fn


@case("to_device")
def _to_device(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    return [rng.standard_normal(shape)], lambda x: (x.to("host2").exp() * 2).to("cpu")


# -- matrix products and the transformer ops ------------------------------------------------------------
@case("matmul")
def _matmul(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    m, k, n = (data.draw(st.integers(1, 4)) for _ in range(3))
    batch = data.draw(shapes(0, 2, max_side=3))
    form = data.draw(st.integers(0, 3))
    a_shape = (k,) if form == 1 else (*broadcastable(data, batch), m, k)
    b_shape = (k,) if form == 2 else (*broadcastable(data, batch), k, n)
    return [rng.standard_normal(a_shape), rng.standard_normal(b_shape)], bt.matmul


@case("linear")
def _linear(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    lead = data.draw(shapes(0, 2))
    fan_in, fan_out = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    inputs = [rng.standard_normal((*lead, fan_in)), rng.standard_normal((fan_out, fan_in))]
    if data.draw(st.booleans()):
        return [*inputs, rng.standard_normal(fan_out)], bt.linear
    return inputs, bt.linear


@case("linear_gelu")
def _linear_gelu(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    lead = data.draw(shapes(0, 2))
    fan_in, fan_out = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    approximate = data.draw(st.sampled_from(("tanh", "none")))
    inputs = [rng.standard_normal((*lead, fan_in)), rng.standard_normal((fan_out, fan_in))]
    if data.draw(st.booleans()):
        return [*inputs, rng.standard_normal(fan_out)], lambda x, w, b: bt.linear_gelu(x, w, b, approximate)
    return inputs, lambda x, w: bt.linear_gelu(x, w, None, approximate)


@case("linear_add")
def _linear_add(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    lead = data.draw(shapes(0, 2))
    fan_in, fan_out = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    inputs = [rng.standard_normal((*lead, fan_out)), rng.standard_normal((*lead, fan_in)),
              rng.standard_normal((fan_out, fan_in))]
    if data.draw(st.booleans()):
        return [*inputs, rng.standard_normal(fan_out)], bt.linear_add
    return inputs, bt.linear_add


def _rows_apart(rng: np.random.Generator, shape: tuple[int, ...], k: int) -> np.ndarray:
    """±1 alternating along the normalized dims plus bounded noise: no near-constant rows."""
    ns = shape[len(shape) - k:]
    sign = np.where(np.arange(math.prod(ns)) % 2 == 0, 1.0, -1.0).reshape(ns)
    return sign + 0.4 * np.tanh(rng.standard_normal(shape))


@case("layer_norm")
def _layer_norm(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    k = data.draw(st.integers(1, len(shape)))
    ns = shape[len(shape) - k:]
    inputs = [_rows_apart(rng, shape, k), rng.uniform(0.5, 2.0, ns), rng.standard_normal(ns)]
    return inputs, lambda x, w, b: bt.layer_norm(x, ns, w, b) * 2 + bt.layer_norm(x, ns)


@case("rms_norm")
def _rms_norm(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    k = data.draw(st.integers(1, len(shape)))
    ns = shape[len(shape) - k:]
    inputs = [_rows_apart(rng, shape, k), rng.uniform(0.5, 2.0, ns)]
    return inputs, lambda x, w: bt.rms_norm(x, ns, w, eps=1e-6) + bt.rms_norm(x, ns, eps=1e-6)


@case("rope")
def _rope(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    B, T, kv = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 2))
    H, D = kv * data.draw(st.integers(1, 2)), data.draw(st.sampled_from((2, 4, 6)))
    angles = rng.uniform(-4.0, 4.0, (T, D // 2))
    cos, sin = bt.tensor(np.cos(angles)), bt.tensor(np.sin(angles))

    def fn(q: Tensor, k: Tensor) -> Tensor:
        qo, ko = bt.rope(q, k, cos.to(dtype=q.dtype), sin.to(dtype=q.dtype))
        return bt.cat([qo.reshape(-1), (ko * 3).reshape(-1)])

    return [rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, kv, D))], fn


@case("swiglu")
def _swiglu(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(0, 3))
    return [rng.standard_normal(shape) * 2, rng.standard_normal(shape)], lambda g, u: bt.swiglu(g, u)


@case("bias_gelu")
def _bias_gelu(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes(1, 3))
    approximate = data.draw(st.sampled_from(("none", "tanh")))
    inputs = [rng.standard_normal(shape), rng.standard_normal(shape[-1])]
    return inputs, lambda x, b: bt.bias_gelu(x, b, approximate)


@case("dropout")
def _dropout(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    p = data.draw(st.sampled_from((0.2, 0.5)))

    def fn(x: Tensor) -> Tensor:
        bt.manual_seed(7)  # the same mask at every evaluation
        return bt.dropout(x, p)

    return [rng.standard_normal(shape)], fn


@case("embedding")
def _embedding(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    vocab, dim = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    idx = bt.tensor(rng.integers(0, vocab, size=data.draw(shapes(0, 2))))
    return [rng.standard_normal((vocab, dim))], lambda w: bt.embedding(idx, w)


@case("cross_entropy")
def _cross_entropy(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    n, c = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    target = rng.integers(0, c, size=n)
    target[rng.random(n) < 0.3] = -100
    kw = {"reduction": data.draw(st.sampled_from(("mean", "sum", "none"))),
          "label_smoothing": data.draw(st.sampled_from((0.0, 0.2)))}
    if kw["reduction"] == "mean" and (target == -100).all():
        target[0] = 0
    t = bt.tensor(target)
    return [rng.standard_normal((n, c))], lambda x: bt.cross_entropy(x, t, **kw)


@case("linear_cross_entropy")
def _linear_cross_entropy(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    lead = data.draw(shapes(1, 2))
    c, v = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    target = rng.integers(0, v, size=lead)
    target[rng.random(lead) < 0.3] = -100
    target.reshape(-1)[0] = 0  # 'mean' over at least one target
    kw = {"reduction": data.draw(st.sampled_from(("mean", "sum"))),
          "label_smoothing": data.draw(st.sampled_from((0.0, 0.2))),
          "chunk_size": data.draw(st.sampled_from((None, 1, 2)))}
    t = bt.tensor(target)
    return ([rng.standard_normal((*lead, c)), rng.standard_normal((v, c))],
            lambda x, w: bt.linear_cross_entropy(x, w, t, **kw))


@case("sdpa")
def _sdpa(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    batch = data.draw(shapes(0, 2, max_side=2))
    L, S, E = (data.draw(st.integers(1, 4)) for _ in range(3))
    kind = data.draw(st.integers(0, 2))
    mask = None
    if kind == 2:
        allowed = rng.random((L, S)) < 0.6
        allowed[:, 0] = True
        mask = bt.tensor(allowed)
    group = data.draw(st.sampled_from((1, 2, 3)))  # > 1: grouped-query attention, heads at dim -3
    kv_batch = batch
    if group > 1:
        kv_batch = (*batch, data.draw(st.integers(1, 2)))
        batch = (*kv_batch[:-1], kv_batch[-1] * group)
    inputs = [rng.standard_normal((*batch, L, E)), rng.standard_normal((*kv_batch, S, E)),
              rng.standard_normal((*kv_batch, S, E))]
    return inputs, lambda q, k, v: bt.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kind == 1,
                                                                   enable_gqa=group > 1)


@case("sdpa_packed")
def _sdpa_packed(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    B, T, H, D = (data.draw(st.integers(1, 3)) for _ in range(4))
    causal = data.draw(st.booleans())
    return [rng.standard_normal((B, T, 3 * H * D))], lambda qkv: bt.self_attention(qkv, H, is_causal=causal)


@case("checkpoint")
def _checkpoint(data: st.DataObject, rng: np.random.Generator) -> Drawn:
    shape = data.draw(shapes())
    return ([rng.standard_normal(shape), rng.standard_normal(shape)],
            lambda a, b: checkpoint(lambda x, y: (x * y).tanh() + x.exp(), a, b))


# -- the checks --------------------------------------------------------------------------------------
def _loss(fn: Fn, inputs: list[Tensor], weight: np.ndarray | None) -> tuple[Tensor, np.ndarray]:
    out = fn(*inputs)
    if weight is None:
        weight = np.random.default_rng(1234).standard_normal(out.shape)
    return (out * bt.tensor(weight, dtype=out.dtype, device=out.device)).sum(), weight


def analytic(fn: Fn, values: list[np.ndarray], dtype: bt.DType, weight: np.ndarray | None = None
             ) -> tuple[list[np.ndarray], np.ndarray]:
    inputs = [bt.tensor(v, dtype=dtype, requires_grad=True) for v in values]
    loss, weight = _loss(fn, inputs, weight)
    loss.backward()  # not grad(): a checkpointed segment needs a full backward pass
    return [np.zeros(v.shape) if t.grad is None else t.grad.numpy().astype(np.float64)
            for t, v in zip(inputs, values, strict=True)], weight


def numeric(fn: Fn, values: list[np.ndarray], weight: np.ndarray, step: float) -> list[np.ndarray]:
    def loss(vs: list[np.ndarray]) -> float:
        with no_grad():
            return float(_loss(fn, [bt.tensor(v, dtype=bt.float64) for v in vs], weight)[0].item())

    out = []
    for i, v in enumerate(values):
        g = np.zeros(v.shape)
        for j in np.ndindex(v.shape):
            hi, lo = [w.copy() for w in values], [w.copy() for w in values]
            hi[i][j] += step
            lo[i][j] -= step
            g[j] = (loss(hi) - loss(lo)) / (2 * step)
        out.append(g)
    return out


def assert_close(got: list[np.ndarray], want: list[np.ndarray], rtol: float, what: str) -> None:
    """‖got − want‖ ≤ rtol · max(‖want‖, √n): relative, except that gradients below unit size (often
    a cancellation of O(1) terms, e.g. layer_norm's) are held to the same error absolutely."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = float(np.linalg.norm(g - w))
        scale = max(float(np.linalg.norm(w)), math.sqrt(max(w.size, 1)))
        assert err <= rtol * scale, f"{what}, input {i}: relative error {err / scale:.3g} > {rtol:g}\n{g}\n{w}"


# The rules this package defines; plugins (tensor and context parallelism) add rules of their own when they are
# imported, and test them themselves, so which tests ran first must not change this list.
# Rules that run only in a half dtype (under autocast), where finite differences mean nothing: each has
# its own test below, against float64 on the same rounded operands.
HALF_ONLY = {"linear_autocast"}
RULE_NAMES = sorted(name for name, rule in RULES.items()
                    if rule.backward.__module__.startswith("blutrain.autograd.") and name not in HALF_ONLY)


def test_every_derivative_rule_has_a_gradient_check() -> None:
    assert sorted(CASES) == RULE_NAMES
    assert set(RULES) >= HALF_ONLY


@settings(max_examples=20, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 40), fan_in=st.integers(1, 40),
       fan_out=st.integers(1, 40), bias=st.booleans())
def test_linear_under_autocast_gives_float32_gradients_of_the_bf16_product(seed: int, rows: int, fan_in: int,
                                                                          fan_out: int, bias: bool) -> None:
    """linear_autocast: float32 x, W, b get float32 gradients equal to the float64 gradients of the same
    product on their bf16-rounded values, up to the rounding of the upstream gradient to bf16."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal((rows, fan_in)), rng.standard_normal((fan_out, fan_in)),
              rng.standard_normal(fan_out)]
    upstream = rng.standard_normal((rows, fan_out))
    ts = [bt.tensor(v, dtype="float32", requires_grad=True) for v in values]
    with bt.autocast():
        out = bt.linear(ts[0], ts[1], ts[2] if bias else None)
    assert out.dtype is bt.bfloat16 and out.grad_fn is not None and out.grad_fn.op == "linear_autocast"
    out.backward(bt.tensor(upstream, dtype="bfloat16"))
    rounded = [bt.tensor(v.astype(bt.bfloat16.np).astype(np.float64), requires_grad=True) for v in values]
    bt.linear(rounded[0], rounded[1], rounded[2] if bias else None).backward(
        bt.tensor(upstream.astype(bt.bfloat16.np).astype(np.float64)))
    for t, r in list(zip(ts, rounded, strict=True))[:3 if bias else 2]:
        assert t.grad is not None and t.grad.dtype is bt.float32 and r.grad is not None
        assert_close([t.grad.numpy().astype(np.float64)], [r.grad.numpy()], 1e-5, "linear_autocast")
    assert bias or ts[2].grad is None


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_rule_agrees_with_finite_differences_in_float64_and_with_float64_in_float32(
        rule: str, second_device: Any) -> None:
    spec = CASES[rule]

    @settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def check(data: st.DataObject, seed: int) -> None:
        values, fn = spec.draw(data, np.random.default_rng(seed))
        values = [np.array(v, dtype=np.float32).astype(np.float64) for v in values]  # exact in both dtypes
        g64, weight = analytic(fn, values, bt.float64)
        assert_close(g64, numeric(fn, values, weight, spec.step), 1e-6, f"{rule}: float64 vs finite differences")
        g32, _ = analytic(fn, values, bt.float32, weight.astype(np.float32).astype(np.float64))
        assert_close(g32, g64, 1e-5, f"{rule}: float32 vs float64")

    check()
