"""How the conformance suite draws inputs for the op catalogue (:mod:`blutrain.kernels.catalogue`).

A :class:`Sample` is one call's arguments; each array argument is an :class:`Arg`, host values and the layout
in which it reaches the op. A sampler (``unary_samples``, ``matmul_samples``, ...: one per argument pattern)
is a hypothesis composite strategy of samples for one dtype: shapes (odd sizes, size 0 and 1, broadcasting),
layouts (transposed, strided, offset and expanded views) and a seed; the values come from NumPy's generator
with that seed, in a range where the op is smooth and representable in every dtype it supports. hypothesis is
imported only when a strategy is built, so importing this module needs NumPy alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import blutrain.tensor as bt
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import ALL_DTYPES, DType, bool_, float64, int64
from blutrain.tensor.tensor import Tensor

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn, SearchStrategy

LAYOUTS = ("contiguous", "transposed", "strided", "offset", "expanded")


def reference_dtype(dtype: DType) -> DType:
    """The dtype the reference computes in: float64 for floating dtypes, exact int64 for integers."""
    if dtype.is_floating:
        return float64
    return bool_ if dtype is bool_ else int64


@dataclass(frozen=True, eq=False)
class Arg:
    """One array argument of a sample: its values on the host, and how it reaches the op.

    ``kind`` "data" takes the dtype under test, "index" is int64, "mask" is bool. ``layout`` is the
    memory layout of the device tensor (the values are the same in every layout): a transposed,
    strided (every other element), offset (storage offset 1) or expanded (stride 0) view. With
    ``grad`` the tensor requires grad and the test compares its gradient.
    """

    value: np.ndarray[Any, Any]
    kind: str = "data"
    layout: str = "contiguous"
    shape: tuple[int, ...] | None = None  # the shape an "expanded" value is broadcast to
    grad: bool = False

    def values(self) -> np.ndarray[Any, Any]:
        """The full values, as every layout shows them."""
        return np.broadcast_to(self.value, self.shape) if self.shape is not None else self.value

    def dtype_for(self, dtype: DType) -> DType:
        return dtype if self.kind == "data" else int64 if self.kind == "index" else bool_

    def on(self, dtype: DType, device: Device) -> Tensor:
        """The argument as a tensor of ``dtype`` on ``device``, in this argument's layout."""
        dt = self.dtype_for(dtype)
        v = self.value
        if self.layout == "transposed" and v.ndim >= 2:
            t = bt.tensor(np.swapaxes(v, -1, -2), dtype=dt, device=device).transpose(-1, -2)
        elif self.layout == "strided" and v.ndim >= 1:
            t = bt.tensor(np.repeat(v, 2, axis=-1), dtype=dt, device=device)[..., ::2]
        elif self.layout == "offset" and v.ndim >= 1:
            padded = np.concatenate([np.zeros((1, *v.shape[1:]), v.dtype), v])
            t = bt.tensor(padded, dtype=dt, device=device)[1:]
        elif self.shape is not None:
            t = bt.tensor(v, dtype=dt, device=device).expand(self.shape)
        else:
            t = bt.tensor(v, dtype=dt, device=device)
        return t.detach().requires_grad_() if self.grad else t

    def reference(self, dtype: DType) -> Tensor:
        """The argument as a contiguous CPU tensor of the reference dtype, holding exactly the values
        the device sees (rounded to ``dtype`` first), so that input rounding is not counted as error."""
        dt = self.dtype_for(dtype)
        seen = np.asarray(self.values()).astype(dt.np)
        t = bt.tensor(seen, dtype=reference_dtype(dt))
        return t.requires_grad_() if self.grad else t

    def __repr__(self) -> str:
        extra = f"->{list(self.shape)}" if self.shape is not None else ""
        grad = ", grad" if self.grad else ""
        return f"Arg({self.kind} {list(self.value.shape)}{extra} {self.layout}{grad})"


@dataclass(frozen=True, eq=False)
class Sample:
    """Positional and keyword arguments for one call; ``grad_seed`` seeds the output gradient."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad_seed: int = 0

    def __repr__(self) -> str:
        return f"Sample(args={self.args!r}, kwargs={self.kwargs!r})"


# -- drawing inputs --------------------------------------------------------------------------------
def strategies() -> Any:
    """hypothesis.strategies, imported when the first strategy is built."""
    from hypothesis import strategies

    return strategies


def _composite(fn: Callable[..., Sample]) -> Callable[..., SearchStrategy[Sample]]:
    """``st.composite`` applied on first use, so defining samplers does not import hypothesis."""

    def build(*args: Any, **kwargs: Any) -> SearchStrategy[Sample]:
        return strategies().composite(fn)(*args, **kwargs)  # type: ignore[no-any-return]

    return build


# Value ranges per domain: floats (low, high) of a uniform draw, or "normal"; ints (low, high).
_FLOAT_DOMAINS: dict[str, tuple[float, float]] = {
    "positive": (0.1, 4.0), "exp": (-8.0, 8.0), "log1p": (-0.8, 4.0), "unit": (-1.0, 1.0),
    "base": (0.2, 3.0), "exponent": (-2.0, 2.0),
}
_INT_DOMAINS: dict[str, tuple[int, int]] = {
    "normal": (-20, 20), "positive": (1, 10), "small": (-3, 3), "exponent": (0, 3), "base": (-3, 3),
    "nonzero": (1, 10), "exp": (-8, 8), "log1p": (0, 4), "unit": (-1, 1),
}


def _int_range(dtype: DType, domain: str) -> tuple[int, int]:
    lo, hi = _INT_DOMAINS.get(domain, _INT_DOMAINS["normal"])
    info = np.iinfo(dtype.np)
    return max(lo, int(info.min)), min(hi, int(info.max))


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType, domain: str) -> np.ndarray[Any, Any]:
    """Host values of ``shape`` for ``dtype`` (float64 for floating dtypes, int64 for integers)."""
    if dtype is bool_:
        return rng.random(shape) < 0.5
    if domain == "distinct":
        # distinct integers, exact in every dtype (they fit int8/uint8 and bfloat16's 8-bit mantissa),
        # so arg-max/min have no ties; beyond 256 elements some values repeat
        n = math.prod(shape)
        start = 0 if dtype is bt.uint8 else -128 if n > 256 else -(n // 2)
        values = rng.permutation(n) % 256 + start
        return values.reshape(shape).astype(np.float64 if dtype.is_floating else np.int64)
    if not dtype.is_floating:
        lo, hi = _int_range(dtype, domain)
        if domain == "nonzero" and lo < 0:
            mag = rng.integers(1, hi + 1, size=shape)
            return np.where(rng.random(shape) < 0.5, -mag, mag).astype(np.int64)
        return rng.integers(lo, hi + 1, size=shape).astype(np.int64)
    if domain == "normal":
        return rng.standard_normal(shape)
    if domain == "nonzero":
        size = rng.uniform(0.5, 3.0, size=shape)
        return np.where(rng.random(shape) < 0.5, -size, size)
    if domain == "coarse":  # multiples of 1/4: exact in every dtype, and with ties (for comparisons)
        return rng.integers(-8, 9, size=shape) / 4.0
    lo_f, hi_f = _FLOAT_DOMAINS[domain]
    return rng.uniform(lo_f, hi_f, size=shape)


def _scalar(rng: np.random.Generator, dtype: DType, domain: str) -> bool | int | float:
    """A Python scalar operand of the same kind as ``dtype``."""
    v = _values(rng, (), dtype, domain)
    if dtype is bool_:
        return bool(v)
    return float(v) if dtype.is_floating else int(v)


def _draw_shape(draw: DrawFn, min_ndim: int = 0, max_ndim: int = 4, zero: bool = True) -> tuple[int, ...]:
    """Mostly sides 1..7; sometimes one odd larger side (9, 13, 17, 33), sometimes one side 0."""
    st = strategies()
    ndim = draw(st.integers(min_ndim, max_ndim))
    sides = [draw(st.integers(1, 7)) for _ in range(ndim)]
    if ndim and draw(st.integers(0, 4)) == 0:
        sides[draw(st.integers(0, ndim - 1))] = draw(st.sampled_from((9, 13, 17, 33)))
    if ndim and zero and draw(st.integers(0, 7)) == 0:
        sides[draw(st.integers(0, ndim - 1))] = 0
    return tuple(sides)


def _draw_arg(draw: DrawFn, rng: np.random.Generator, shape: tuple[int, ...], dtype: DType,
              domain: str = "normal", kind: str = "data", grad: bool = False,
              layouts: Sequence[str] = LAYOUTS) -> Arg:
    """An argument of ``shape`` in a drawn layout; "expanded" draws values constant along some dims."""
    st = strategies()
    layout = draw(st.sampled_from(tuple(layouts)))
    dt = dtype if kind == "data" else int64 if kind == "index" else bool_
    if layout == "expanded":
        small = tuple(1 if s and draw(st.booleans()) else s for s in shape)
        return Arg(_values(rng, small, dt, domain), kind, layout, shape, grad)
    return Arg(_values(rng, shape, dt, domain), kind, layout, None, grad)


def _rng(draw: DrawFn) -> tuple[np.random.Generator, int]:
    seed = draw(strategies().integers(0, 2**32 - 1))
    return np.random.default_rng(seed), seed


def _broadcast_operand(draw: DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: some leading dims dropped, some dims made 1."""
    st = strategies()
    drop = draw(st.integers(0, len(shape))) if draw(st.booleans()) else 0
    return tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in shape[drop:])


def _index_values(rng: np.random.Generator, shape: tuple[int, ...], size: int, negative: bool = False
                  ) -> np.ndarray[Any, Any]:
    """Indices into a dim of ``size`` (callers give an empty ``shape`` when ``size`` is 0)."""
    lo = -size if negative else 0
    return rng.integers(lo, size, size=shape) if size else np.zeros(shape, np.int64)


# -- samplers (one per argument pattern) ------------------------------------------------------------
@_composite
def unary_samples(draw: DrawFn, dtype: DType, domain: str = "normal", grad: bool = False,
                  kwargs: Callable[[DrawFn], dict[str, Any]] | None = None) -> Sample:
    rng, seed = _rng(draw)
    x = _draw_arg(draw, rng, _draw_shape(draw), dtype, domain, grad=grad)
    return Sample((x,), kwargs(draw) if kwargs else {}, seed)


@_composite
def binary_samples(draw: DrawFn, dtype: DType, domain_a: str = "normal", domain_b: str = "normal",
                   scalars: bool = True) -> Sample:
    """Two operands broadcasting to a drawn shape; sometimes one is a Python scalar."""
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw)
    a: Any = _draw_arg(draw, rng, _broadcast_operand(draw, shape), dtype, domain_a)
    b: Any = _draw_arg(draw, rng, _broadcast_operand(draw, shape), dtype, domain_b)
    which = draw(st.integers(0, 5)) if scalars else 0
    if which == 1:
        b = _scalar(rng, dtype, domain_b)
    elif which == 2:
        a = _scalar(rng, dtype, domain_a)
    return Sample((a, b), {}, seed)


@_composite
def where_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw)
    cond = _draw_arg(draw, rng, _broadcast_operand(draw, shape), dtype, kind="mask")
    a: Any = _draw_arg(draw, rng, _broadcast_operand(draw, shape), dtype)
    b: Any = _draw_arg(draw, rng, _broadcast_operand(draw, shape), dtype)
    which = draw(st.integers(0, 4))
    if which == 1:
        b = _scalar(rng, dtype, "normal")
    elif which == 2:
        a = _scalar(rng, dtype, "normal")
    return Sample((cond, a, b), {}, seed)


@_composite
def clamp_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    x = _draw_arg(draw, rng, _draw_shape(draw), dtype)
    lo, hi = sorted((_scalar(rng, dtype, "normal"), _scalar(rng, dtype, "normal")))
    which = draw(st.integers(0, 2))
    return Sample((x,), {"min": None if which == 1 else lo, "max": None if which == 2 else hi}, seed)


@_composite
def cast_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    target = draw(strategies().sampled_from(ALL_DTYPES))
    # values every dtype holds: small non-negative numbers (uint8) on a 1/4 grid (exact in bf16)
    x = _draw_arg(draw, rng, _draw_shape(draw), dtype, "exponent" if not dtype.is_floating else "positive")
    if dtype.is_floating:
        x = Arg(np.round(x.value * 4) / 4, x.kind, x.layout, x.shape, x.grad)
    return Sample((x,), {"target": target.name}, seed)


def _dims(draw: DrawFn, ndim: int, multiple: bool = True, none: bool = True) -> int | tuple[int, ...] | None:
    """A ``dim`` argument: None, one dim (maybe negative) or several."""
    st = strategies()
    choice = draw(st.integers(0 if none else 1, 2 if multiple and ndim else 1)) if ndim else 0
    if choice == 0:
        return None
    if choice == 1:
        return draw(st.integers(-ndim, ndim - 1)) if ndim else 0
    picked = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return tuple(d - ndim if draw(st.booleans()) else d for d in picked)


def _reduced_sides(shape: tuple[int, ...], dim: int | tuple[int, ...] | None) -> list[int]:
    if dim is None:
        return list(shape)
    dims = (dim,) if isinstance(dim, int) else dim
    return [shape[d] for d in dims] if shape else []


@_composite
def reduction_samples(draw: DrawFn, dtype: DType, domain: str = "normal", multiple: bool = True,
                      none: bool = True, nonempty: bool = False, grad: bool = False,
                      extra: Callable[[DrawFn], dict[str, Any]] | None = None) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, min_ndim=0 if none else 1)
    dim = _dims(draw, len(shape), multiple, none)
    if nonempty and 0 in _reduced_sides(shape, dim):
        shape = tuple(max(s, 1) for s in shape)
    x = _draw_arg(draw, rng, shape, dtype, domain, grad=grad)
    kwargs: dict[str, Any] = {"dim": dim, "keepdim": draw(st.booleans())}
    if extra is not None:
        kwargs.update(extra(draw))
    return Sample((x,), kwargs, seed)


@_composite
def dim_samples(draw: DrawFn, dtype: DType, domain: str = "normal", grad: bool = False) -> Sample:
    """One tensor and one ``dim`` (softmax family)."""
    rng, seed = _rng(draw)
    shape = _draw_shape(draw)
    dim = draw(strategies().integers(-len(shape), len(shape) - 1)) if shape else 0
    return Sample((_draw_arg(draw, rng, shape, dtype, domain, grad=grad),), {"dim": dim}, seed)


@_composite
def matmul_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """Vector and matrix operands, and batches that broadcast (odd sizes, sizes 0 and 1)."""
    st = strategies()
    rng, seed = _rng(draw)
    side = st.sampled_from((0, 1, 2, 3, 5, 7, 13, 1, 2, 3, 5))
    m, k, n = draw(side), draw(side), draw(side)
    batch = _draw_shape(draw, 0, 2, zero=False) if draw(st.booleans()) else ()
    a_shape = (k,) if draw(st.integers(0, 4)) == 0 else (*_broadcast_operand(draw, batch), m, k)
    b_shape = (k,) if draw(st.integers(0, 4)) == 0 else (*_broadcast_operand(draw, batch), k, n)
    domain = "normal" if dtype.is_floating else "small"
    a = _draw_arg(draw, rng, a_shape, dtype, domain, grad=grad)
    b = _draw_arg(draw, rng, b_shape, dtype, domain, grad=grad)
    return Sample((a, b), {}, seed)


@_composite
def linear_samples(draw: DrawFn, dtype: DType, grad: bool = False, gelu: bool = False) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    side = st.sampled_from((0, 1, 2, 3, 5, 7, 13, 1, 3, 5))
    fan_in, fan_out = draw(side), draw(side)
    lead = _draw_shape(draw, 0, 2)
    domain = "normal" if dtype.is_floating else "small"
    x = _draw_arg(draw, rng, (*lead, fan_in), dtype, domain, grad=grad)
    w = _draw_arg(draw, rng, (fan_out, fan_in), dtype, domain, grad=grad)
    b = _draw_arg(draw, rng, (fan_out,), dtype, domain, grad=grad) if draw(st.booleans()) else None
    if gelu:
        return Sample((x, w, b, draw(st.sampled_from(("tanh", "none")))), {}, seed)
    return Sample((x, w, b), {}, seed)


@_composite
def linear_add_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """(residual, input, weight, bias or None): the residual has the product's shape."""
    st = strategies()
    rng, seed = _rng(draw)
    side = st.sampled_from((0, 1, 2, 3, 5, 7, 13, 1, 3, 5))
    fan_in, fan_out = draw(side), draw(side)
    lead = _draw_shape(draw, 0, 2)
    r = _draw_arg(draw, rng, (*lead, fan_out), dtype, "normal", grad=grad)
    x = _draw_arg(draw, rng, (*lead, fan_in), dtype, "normal", grad=grad)
    w = _draw_arg(draw, rng, (fan_out, fan_in), dtype, "normal", grad=grad)
    b = _draw_arg(draw, rng, (fan_out,), dtype, "normal", grad=grad) if draw(st.booleans()) else None
    return Sample((r, x, w, b), {}, seed)


@_composite
def getitem_samples(draw: DrawFn, dtype: DType) -> Sample:
    """Advanced keys: integer tensors (negative entries too), bool masks, mixed with slices."""
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 3, zero=False)
    x = _draw_arg(draw, rng, shape, dtype)
    kind = draw(st.integers(0, 3))
    if kind == 0:  # x[mask] with a mask over the leading dims
        lead = draw(st.integers(1, len(shape)))
        key: tuple[Any, ...] = (_draw_arg(draw, rng, shape[:lead], dtype, kind="mask", layouts=("contiguous",)),)
    elif kind == 1:  # x[..., idx] on the last dim
        idx = _index_values(rng, _draw_shape(draw, 0, 2), shape[-1], negative=True)
        key = (Ellipsis, Arg(idx, "index"))
    elif kind == 2 and len(shape) >= 2:  # x[i, :, j] style: two index tensors that broadcast
        i = _index_values(rng, (3,), shape[0])
        j = _index_values(rng, (1,), shape[-1])
        key = (Arg(i, "index"), *(slice(None),) * (len(shape) - 2), Arg(j, "index"))
    else:  # x[idx] with repeats, plus a step slice on the next dim
        idx = _index_values(rng, _draw_shape(draw, 1, 2), shape[0])
        key = (Arg(idx, "index"), *((slice(None, None, 2),) if len(shape) > 1 else ()))
    return Sample((x, *key), {}, seed)


def _key_shape(shape: tuple[int, ...], key: tuple[Any, ...]) -> tuple[int, ...]:
    host = tuple(k.values() if isinstance(k, Arg) else k for k in key)
    return tuple(int(s) for s in np.empty(shape, np.int8)[host].shape)


@_composite
def setitem_samples(draw: DrawFn, dtype: DType) -> Sample:
    """``x[key] = value`` with slices, integer tensors and bool masks; or index_put_ with accumulate."""
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 3, zero=False)
    writable = ("contiguous", "transposed", "strided", "offset")
    x = _draw_arg(draw, rng, shape, dtype, layouts=writable)
    kind = draw(st.integers(0, 3))
    accumulate = False
    if kind == 0:
        key: tuple[Any, ...] = (_draw_arg(draw, rng, shape, dtype, kind="mask", layouts=("contiguous",)),)
    elif kind == 1:
        key = (slice(None, None, 2), *((slice(1, None),) if len(shape) > 1 else ()))
    elif kind == 2:  # unique indices: plain assignment with repeats has no defined winner
        count = draw(st.integers(0, shape[0]))
        key = (Arg(rng.permutation(shape[0])[:count], "index"),)
    else:
        key = (Arg(_index_values(rng, _draw_shape(draw, 1, 1), shape[0]), "index"),)
        accumulate = True
    target = _key_shape(shape, key)
    vshape = target[draw(st.integers(0, len(target))):] if draw(st.booleans()) else target
    value = _draw_arg(draw, rng, vshape, dtype)
    return Sample((x, value, *key), {"accumulate": accumulate}, seed)


@_composite
def index_select_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 3)
    dim = draw(strategies().integers(-len(shape), len(shape) - 1))
    idx = _index_values(rng, (draw(strategies().integers(0, 9)) if shape[dim] else 0,), shape[dim])
    return Sample((_draw_arg(draw, rng, shape, dtype), dim, Arg(idx, "index")), {}, seed)


@_composite
def gather_samples(draw: DrawFn, dtype: DType, scatter: bool = False) -> Sample:
    """gather(x, dim, index) or scatter_add(x, dim, index, src): index no larger than x off ``dim``."""
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 3)
    d = draw(st.integers(0, len(shape) - 1))
    ishape = tuple(draw(st.integers(0, 5)) if i == d else draw(st.integers(0, s)) for i, s in enumerate(shape))
    if shape[d] == 0:
        ishape = tuple(0 if i == d else s for i, s in enumerate(ishape))
    idx = Arg(_index_values(rng, ishape, shape[d]), "index")
    x = _draw_arg(draw, rng, shape, dtype)
    if scatter:
        return Sample((x, d, idx, _draw_arg(draw, rng, ishape, dtype)), {}, seed)
    return Sample((x, d, idx), {}, seed)


@_composite
def index_add_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 3)
    d = draw(st.integers(0, len(shape) - 1))
    k = draw(st.integers(0, 7)) if shape[d] else 0
    idx = Arg(_index_values(rng, (k,), shape[d]), "index")
    src = _draw_arg(draw, rng, tuple(k if i == d else s for i, s in enumerate(shape)), dtype)
    return Sample((_draw_arg(draw, rng, shape, dtype), d, idx, src), {}, seed)


@_composite
def tri_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    x = _draw_arg(draw, rng, _draw_shape(draw, 2, 4), dtype)
    return Sample((x,), {"diagonal": draw(strategies().integers(-3, 3))}, seed)


@_composite
def cat_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 3)
    d = draw(st.integers(-len(shape), len(shape) - 1))
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        part = tuple(draw(st.integers(0, 5)) if i == d % len(shape) else s for i, s in enumerate(shape))
        parts.append(_draw_arg(draw, rng, part, dtype))
    return Sample(tuple(parts), {"dim": d}, seed)


@_composite
def embedding_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    st = strategies()
    rng, seed = _rng(draw)
    vocab, dim = draw(st.integers(1, 17)), draw(st.integers(0, 7))
    idx = _index_values(rng, _draw_shape(draw, 0, 3), vocab)  # repeats: backward sums their rows
    w = _draw_arg(draw, rng, (vocab, dim), dtype, grad=grad)
    return Sample((Arg(idx, "index"), w), {}, seed)


@_composite
def norm_layer_samples(draw: DrawFn, dtype: DType, rms: bool = False, grad: bool = False) -> Sample:
    """layer_norm / rms_norm over 1 or 2 trailing dims, with and without affine parameters."""
    st = strategies()
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 4)
    k = draw(st.integers(1, min(2, len(shape))))
    ns = shape[len(shape) - k:]
    # Rows of (nearly) equal values are where normalization is ill-conditioned on any device: rstd
    # approaches 1/√eps and multiplies the last-bit rounding of x − mean. So rows alternate ±1 plus
    # bounded noise along the normalized dims, and are never expanded (constant) views.
    x = _draw_arg(draw, rng, shape, dtype, grad=grad, layouts=LAYOUTS[:-1])
    sign = np.where(np.arange(math.prod(ns)) % 2 == 0, 1.0, -1.0).reshape(ns)
    x = Arg(0.4 * np.tanh(x.value) + sign, x.kind, x.layout, None, x.grad)
    w = _draw_arg(draw, rng, ns, dtype, "positive", grad=grad) if draw(st.booleans()) else None
    if rms:
        # eps=None means the dtype's machine epsilon, which the float64 reference must be told
        eps = draw(st.sampled_from((None, 1e-6)))
        eps = float(np.finfo(dtype.np).eps) if eps is None and dtype is not bt.bfloat16 else eps
        return Sample((x, list(ns), w), {"eps": 2.0**-7 if eps is None else eps}, seed)
    b = _draw_arg(draw, rng, ns, dtype, grad=grad) if draw(st.booleans()) else None
    return Sample((x, list(ns), w, b), {"eps": 1e-5}, seed)


@_composite
def bias_gelu_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """An input of 1 to 4 dims and a bias over its last dim, each in any layout; both GELU forms."""
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 1, 4)
    x = _draw_arg(draw, rng, shape, dtype, grad=grad)
    b = _draw_arg(draw, rng, shape[-1:], dtype, grad=grad)
    return Sample((x, b), {"approximate": draw(strategies().sampled_from(("none", "tanh")))}, seed)


@_composite
def cross_entropy_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """Logits (N, C), (C,) or (N, C, d); some targets ignored; every reduction; label smoothing."""
    st = strategies()
    rng, seed = _rng(draw)
    c = draw(st.integers(1, 9))
    form = draw(st.integers(0, 2))
    n = draw(st.integers(0, 7)) if form != 1 else 0
    d = draw(st.integers(1, 4))
    lead = (n, c) if form == 0 else (c,) if form == 1 else (n, c, d)
    tshape = (n,) if form == 0 else () if form == 1 else (n, d)
    ignore = draw(st.sampled_from((-100, 0)))
    target = rng.integers(0, c, size=tshape)
    if form != 1:
        target = np.where(rng.random(tshape) < 0.2, ignore, target)
    logits = _draw_arg(draw, rng, lead, dtype, grad=grad)
    kwargs = {"ignore_index": ignore, "reduction": draw(st.sampled_from(("mean", "sum", "none"))),
              "label_smoothing": draw(st.sampled_from((0.0, 0.1)))}
    return Sample((logits, Arg(np.asarray(target), "index")), kwargs, seed)


@_composite
def linear_cross_entropy_samples(draw: DrawFn, dtype: DType) -> Sample:
    """Rows (..., C) against a (V, C) head; some targets ignored; 'mean' or 'sum'; label smoothing; chunks
    of every size (one row, a part, all); inputs that require grad or not."""
    st = strategies()
    rng, seed = _rng(draw)
    c, v = draw(st.sampled_from((1, 3, 5, 8))), draw(st.sampled_from((1, 2, 7, 13)))
    lead = _draw_shape(draw, 0, 2)
    grad = draw(st.booleans())
    ignore = draw(st.sampled_from((-100, 0)))
    target = rng.integers(0, v, size=lead)
    target = np.where(rng.random(lead) < 0.2, ignore, target)
    x = _draw_arg(draw, rng, (*lead, c), dtype, grad=grad)
    w = _draw_arg(draw, rng, (v, c), dtype, grad=grad)
    kwargs = {"ignore_index": ignore, "reduction": draw(st.sampled_from(("mean", "sum"))),
              "label_smoothing": draw(st.sampled_from((0.0, 0.1))),
              "chunk_size": draw(st.sampled_from((None, 1, 2, 5)))}
    return Sample((x, w, Arg(np.asarray(target), "index")), kwargs, seed)


@_composite
def sdpa_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """q (…, L, E), k (…, S, E), v (…, S, Ev); causal, a bool or float mask, or none; or grouped-query
    attention (``enable_gqa``): q (…, H_kv·group, L, E) with k and v of H_kv heads."""
    st = strategies()
    rng, seed = _rng(draw)
    batch = _draw_shape(draw, 0, 2, zero=False)
    side = st.integers(1, 9)
    L, S, E, Ev = draw(side), draw(side), draw(side), draw(side)
    group = draw(st.sampled_from((1, 1, 2, 3)))
    kv_batch = batch
    if group > 1:  # heads at dim -3: H_kv for key and value, H_kv * group for the query
        kv_batch = (*batch, draw(st.integers(1, 3)))
        batch = (*kv_batch[:-1], kv_batch[-1] * group)
    q = _draw_arg(draw, rng, (*batch, L, E), dtype, grad=grad)
    k = _draw_arg(draw, rng, (*kv_batch, S, E), dtype, grad=grad)
    v = _draw_arg(draw, rng, (*kv_batch, S, Ev), dtype, grad=grad)
    kind = draw(st.integers(0, 3))
    kwargs: dict[str, Any] = {"is_causal": kind == 1, "scale": draw(st.sampled_from((None, 0.3)))}
    if group > 1:
        kwargs["enable_gqa"] = True
    mask: Arg | None = None
    if kind == 2:  # bool mask; key 0 always visible, so no row is fully masked
        allowed = rng.random((L, S)) < 0.7
        allowed[:, 0] = True
        mask = Arg(allowed, "mask")
    elif kind == 3:
        mask = Arg(rng.standard_normal((L, S)), "data")
    return Sample((q, k, v, mask), kwargs, seed)


@_composite
def sdpa_packed_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """A packed qkv (B, T, 3·H·D) in any layout; head dims small and odd or 64 (a fused kernel's size); causal
    or not; the default or a given scale."""
    st = strategies()
    rng, seed = _rng(draw)
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    T = draw(st.sampled_from((1, 2, 3, 5, 8, 9, 17, 33)))
    D = draw(st.sampled_from((1, 3, 8, 64)))
    qkv = _draw_arg(draw, rng, (B, T, 3 * H * D), dtype, grad=grad)
    kwargs = {"is_causal": draw(st.booleans()), "scale": draw(st.sampled_from((None, 0.3)))}
    return Sample((qkv, H), kwargs, seed)


@_composite
def rope_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """q (B, T, H, D) and k (B, T, H_kv, D) in any layout but expanded, D even (2 to 64), H_kv dividing H
    (grouped-query attention); cos and sin (T, D/2) of real angles of each position and frequency."""
    st = strategies()
    rng, seed = _rng(draw)
    B, T = draw(st.integers(1, 3)), draw(st.sampled_from((0, 1, 2, 5, 9, 17)))
    kv = draw(st.integers(1, 3))
    H, D = kv * draw(st.integers(1, 3)), draw(st.sampled_from((2, 4, 6, 16, 64)))
    q = _draw_arg(draw, rng, (B, T, H, D), dtype, grad=grad, layouts=LAYOUTS[:-1])
    k = _draw_arg(draw, rng, (B, T, kv, D), dtype, grad=grad, layouts=LAYOUTS[:-1])
    angles = np.outer(np.arange(T) + draw(st.integers(0, 4000)), 10000.0 ** (-np.arange(D // 2) * 2.0 / D))
    return Sample((q, k, Arg(np.cos(angles)), Arg(np.sin(angles))), {}, seed)


@_composite
def swiglu_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """gate and up of one shape (0 to 4 dims), each in any layout."""
    rng, seed = _rng(draw)
    shape = _draw_shape(draw, 0, 4)
    gate = _draw_arg(draw, rng, shape, dtype, grad=grad)
    return Sample((gate, _draw_arg(draw, rng, shape, dtype, grad=grad)), {}, seed)


@_composite
def dropout_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    x = _draw_arg(draw, rng, _draw_shape(draw), dtype, "nonzero", grad=True)
    return Sample((x,), {"p": draw(strategies().sampled_from((0.1, 0.5, 0.9, 1.0)))}, seed)


@_composite
def full_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    return Sample((_draw_shape(draw), _scalar(rng, dtype, "normal")), {}, seed)


@_composite
def arange_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    if dtype.is_floating:
        start = draw(st.integers(-20, 20)) / 4
        step = draw(st.sampled_from((0.25, 0.5, 1.0, 1.5, -0.5, -1.25)))
        end = start + step * draw(st.integers(0, 40)) + step / 2
    else:
        lo, hi = _int_range(dtype, "normal")
        start = draw(st.integers(lo, hi))
        step = draw(st.sampled_from((1, 2, 3, -1, -2)))
        end = draw(st.integers(lo, hi))
    return Sample((start, end, step), {}, 0)


@_composite
def linspace_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    lo, hi = (-20, 20) if dtype is not bt.uint8 else (0, 40)
    return Sample((draw(st.integers(lo, hi)), draw(st.integers(lo, hi)), draw(st.integers(0, 33))), {}, 0)


@_composite
def eye_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = strategies()
    return Sample((draw(st.integers(0, 9)), draw(st.integers(0, 9))), {}, 0)


__all__ = [
    "LAYOUTS", "Arg", "Sample", "arange_samples", "bias_gelu_samples", "binary_samples", "cast_samples",
    "cat_samples", "clamp_samples", "cross_entropy_samples", "dim_samples", "dropout_samples", "embedding_samples",
    "eye_samples", "full_samples", "gather_samples", "getitem_samples", "index_add_samples", "index_select_samples",
    "linear_add_samples", "linear_cross_entropy_samples", "linear_samples", "linspace_samples", "matmul_samples",
    "norm_layer_samples", "reduction_samples", "reference_dtype", "rope_samples", "sdpa_packed_samples",
    "sdpa_samples", "setitem_samples", "swiglu_samples", "tri_samples", "unary_samples", "where_samples",
]
