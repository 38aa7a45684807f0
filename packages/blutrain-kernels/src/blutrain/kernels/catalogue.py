"""The op catalogue: every kernel op a device implements, what it means, and how it is tested.

An op here is a kernel name of the registry (``blutrain_register_kernels``): the contract a backend
plugin fills. Each :class:`OpInfo` says how a user reaches the op (``signature``, through the public
API of ``blutrain.tensor``), which compute dtypes a device must support, what it means in one line,
how to draw inputs for it (``samples``: hypothesis strategies, one per dtype) and how to call it
(``call``: the public op on tensors; the conformance suite calls it once on the device under test
and once on float64 CPU tensors, the reference). Backward kernels have no public function of their
own: they are reached through ``Tensor.backward`` and their entries compare input gradients.

Inputs are drawn from hypothesis as shapes (odd sizes, size 0 and 1, broadcasting), layouts
(transposed, strided, offset and expanded views) and a seed; the values come from NumPy's generator
with that seed, in a range where the op is smooth and representable in every dtype it supports.
hypothesis is imported only when a strategy is built, so importing the catalogue needs NumPy alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import blutrain.tensor as bt
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import (
    ALL_DTYPES,
    FLOATING_DTYPES,
    INTEGER_DTYPES,
    NUMERIC_DTYPES,
    DType,
    bool_,
    float64,
    int64,
)
from blutrain.tensor.tensor import Tensor

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn, SearchStrategy

BOOL: tuple[DType, ...] = (bool_,)
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


@dataclass(frozen=True, eq=False)
class OpInfo:
    """One kernel op of the registry, documented and made testable.

    ``call(*args, **kwargs)`` reaches the op through the public API. For a ``factory`` op it also
    receives ``dtype=`` and ``device=``. For a ``backward`` op the suite runs ``call`` on arguments
    that require grad, back-propagates a random gradient from its first output and compares the
    arguments' gradients. ``reference``, when given, replaces the float64 call: it receives the
    device's outputs (as float64 CPU tensors) and the reference arguments, for ops whose result
    depends on a device random stream (dropout).
    """

    name: str
    signature: str
    meaning: str
    dtypes: tuple[DType, ...]
    samples: Callable[[DType], SearchStrategy[Sample]]
    call: Callable[..., Any]
    backward: bool = False
    factory: bool = False
    reference: Callable[..., Any] | None = None


CATALOGUE: dict[str, OpInfo] = {}


def get_op(name: str) -> OpInfo:
    """The catalogue entry of ``name``; an unknown name lists the known ones."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise KeyError(f"no op {name!r} in the catalogue; known: {', '.join(sorted(CATALOGUE))}") from None


def _op(name: str, signature: str, meaning: str, dtypes: Sequence[DType],
        samples: Callable[[DType], SearchStrategy[Sample]], call: Callable[..., Any], **kw: Any) -> None:
    if name in CATALOGUE:
        raise ValueError(f"op {name!r} is in the catalogue twice")
    CATALOGUE[name] = OpInfo(name, signature, meaning, tuple(dtypes), samples, call, **kw)


# -- drawing inputs --------------------------------------------------------------------------------
def _st() -> Any:
    """hypothesis.strategies, imported when the first strategy is built."""
    from hypothesis import strategies

    return strategies


def _composite(fn: Callable[..., Sample]) -> Callable[..., SearchStrategy[Sample]]:
    """``st.composite`` applied on first use, so defining samplers does not import hypothesis."""

    def build(*args: Any, **kwargs: Any) -> SearchStrategy[Sample]:
        return _st().composite(fn)(*args, **kwargs)  # type: ignore[no-any-return]

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
    st = _st()
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
    st = _st()
    layout = draw(st.sampled_from(tuple(layouts)))
    dt = dtype if kind == "data" else int64 if kind == "index" else bool_
    if layout == "expanded":
        small = tuple(1 if s and draw(st.booleans()) else s for s in shape)
        return Arg(_values(rng, small, dt, domain), kind, layout, shape, grad)
    return Arg(_values(rng, shape, dt, domain), kind, layout, None, grad)


def _rng(draw: DrawFn) -> tuple[np.random.Generator, int]:
    seed = draw(_st().integers(0, 2**32 - 1))
    return np.random.default_rng(seed), seed


def _broadcast_operand(draw: DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: some leading dims dropped, some dims made 1."""
    st = _st()
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
    st = _st()
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
    st = _st()
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
    st = _st()
    rng, seed = _rng(draw)
    x = _draw_arg(draw, rng, _draw_shape(draw), dtype)
    lo, hi = sorted((_scalar(rng, dtype, "normal"), _scalar(rng, dtype, "normal")))
    which = draw(st.integers(0, 2))
    return Sample((x,), {"min": None if which == 1 else lo, "max": None if which == 2 else hi}, seed)


@_composite
def cast_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    target = draw(_st().sampled_from(ALL_DTYPES))
    # values every dtype holds: small non-negative numbers (uint8) on a 1/4 grid (exact in bf16)
    x = _draw_arg(draw, rng, _draw_shape(draw), dtype, "exponent" if not dtype.is_floating else "positive")
    if dtype.is_floating:
        x = Arg(np.round(x.value * 4) / 4, x.kind, x.layout, x.shape, x.grad)
    return Sample((x,), {"target": target.name}, seed)


def _dims(draw: DrawFn, ndim: int, multiple: bool = True, none: bool = True) -> int | tuple[int, ...] | None:
    """A ``dim`` argument: None, one dim (maybe negative) or several."""
    st = _st()
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
    st = _st()
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
    dim = draw(_st().integers(-len(shape), len(shape) - 1)) if shape else 0
    return Sample((_draw_arg(draw, rng, shape, dtype, domain, grad=grad),), {"dim": dim}, seed)


@_composite
def matmul_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """Vector and matrix operands, and batches that broadcast (odd sizes, sizes 0 and 1)."""
    st = _st()
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
    st = _st()
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
    st = _st()
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
    st = _st()
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
    st = _st()
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
    dim = draw(_st().integers(-len(shape), len(shape) - 1))
    idx = _index_values(rng, (draw(_st().integers(0, 9)) if shape[dim] else 0,), shape[dim])
    return Sample((_draw_arg(draw, rng, shape, dtype), dim, Arg(idx, "index")), {}, seed)


@_composite
def gather_samples(draw: DrawFn, dtype: DType, scatter: bool = False) -> Sample:
    """gather(x, dim, index) or scatter_add(x, dim, index, src): index no larger than x off ``dim``."""
    st = _st()
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
    st = _st()
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
    return Sample((x,), {"diagonal": draw(_st().integers(-3, 3))}, seed)


@_composite
def cat_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = _st()
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
    st = _st()
    rng, seed = _rng(draw)
    vocab, dim = draw(st.integers(1, 17)), draw(st.integers(0, 7))
    idx = _index_values(rng, _draw_shape(draw, 0, 3), vocab)  # repeats: backward sums their rows
    w = _draw_arg(draw, rng, (vocab, dim), dtype, grad=grad)
    return Sample((Arg(idx, "index"), w), {}, seed)


@_composite
def norm_layer_samples(draw: DrawFn, dtype: DType, rms: bool = False, grad: bool = False) -> Sample:
    """layer_norm / rms_norm over 1 or 2 trailing dims, with and without affine parameters."""
    st = _st()
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
    return Sample((x, b), {"approximate": draw(_st().sampled_from(("none", "tanh")))}, seed)


@_composite
def cross_entropy_samples(draw: DrawFn, dtype: DType, grad: bool = False) -> Sample:
    """Logits (N, C), (C,) or (N, C, d); some targets ignored; every reduction; label smoothing."""
    st = _st()
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
    st = _st()
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
    """q (…, L, E), k (…, S, E), v (…, S, Ev); causal, a bool or float mask, or none."""
    st = _st()
    rng, seed = _rng(draw)
    batch = _draw_shape(draw, 0, 2, zero=False)
    side = st.integers(1, 9)
    L, S, E, Ev = draw(side), draw(side), draw(side), draw(side)
    q = _draw_arg(draw, rng, (*batch, L, E), dtype, grad=grad)
    k = _draw_arg(draw, rng, (*batch, S, E), dtype, grad=grad)
    v = _draw_arg(draw, rng, (*batch, S, Ev), dtype, grad=grad)
    kind = draw(st.integers(0, 3))
    kwargs: dict[str, Any] = {"is_causal": kind == 1, "scale": draw(st.sampled_from((None, 0.3)))}
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
    st = _st()
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
    st = _st()
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
    return Sample((x,), {"p": draw(_st().sampled_from((0.1, 0.5, 0.9, 1.0)))}, seed)


@_composite
def full_samples(draw: DrawFn, dtype: DType) -> Sample:
    rng, seed = _rng(draw)
    return Sample((_draw_shape(draw), _scalar(rng, dtype, "normal")), {}, seed)


@_composite
def arange_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = _st()
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
    st = _st()
    lo, hi = (-20, 20) if dtype is not bt.uint8 else (0, 40)
    return Sample((draw(st.integers(lo, hi)), draw(st.integers(lo, hi)), draw(st.integers(0, 33))), {}, 0)


@_composite
def eye_samples(draw: DrawFn, dtype: DType) -> Sample:
    st = _st()
    return Sample((draw(st.integers(0, 9)), draw(st.integers(0, 9))), {}, 0)


# -- calls through the public API ------------------------------------------------------------------
def _getitem(x: Tensor, *key: Any) -> Tensor:
    return x[key]


def _setitem(x: Tensor, value: Tensor, *key: Any, accumulate: bool) -> Tensor:
    if accumulate:
        return bt.index_put_(x, key, value, accumulate=True)
    x[key] = value
    return x


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, **kw: Any) -> Tensor:
    if mask is not None and mask.dtype.is_floating:
        mask = mask.to(dtype=q.dtype)
    return bt.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def _dropout(x: Tensor, p: float) -> tuple[Tensor, Tensor | None]:
    """The output and the input's gradient for an upstream gradient of 2: both show the mask."""
    y = bt.dropout(x, p, training=True)
    y.backward(bt.full(y.shape, 2.0, dtype=y.dtype, device=y.device))
    return y, x.grad


def _dropout_reference(outputs: tuple[Tensor, Tensor], x: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """Kept elements are the non-zero outputs (the inputs are non-zero): scaled by 1/(1-p) there."""
    y = outputs[0]
    kept = y != 0
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    with_x = bt.where(kept, x.detach() * scale, 0.0)
    return with_x, bt.where(kept, bt.full(y.shape, 2.0 * scale, dtype=float64), 0.0)


def _rope_joined(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Both outputs of rope in one tensor, so the backward entry's one output gradient reaches q and k."""
    qo, ko = bt.rope(q, k, cos, sin)
    return bt.cat([qo.reshape(-1), ko.reshape(-1)])


def _fn(name: str) -> Callable[..., Any]:
    return getattr(bt, name)  # type: ignore[no-any-return]


def _loss_and_grads(x: Tensor, w: Tensor, target: Tensor, **kwargs: Any) -> Any:
    """linear_cross_entropy's loss, and the input and weight gradients when they require grad: its kernel
    computes them in the forward, so one entry checks both."""
    loss = bt.linear_cross_entropy(x, w, target, **kwargs)
    if not (x.requires_grad or w.requires_grad):
        return loss
    loss.backward()
    return loss.detach(), x.grad, w.grad


def _operator(symbol: str) -> Callable[..., Any]:
    import operator

    return {"//": operator.floordiv, "%": operator.mod, "&": operator.and_, "|": operator.or_,
            "^": operator.xor}[symbol]


# -- the catalogue ------------------------------------------------------------------------------------
_BINARY = {
    # name: (dtypes, meaning, call, domain of a, domain of b)
    "add": (ALL_DTYPES, "elementwise a + b with broadcasting (logical or for bool)", _fn("add"), "normal", "normal"),
    "sub": (NUMERIC_DTYPES, "elementwise a − b with broadcasting", _fn("sub"), "normal", "normal"),
    "mul": (ALL_DTYPES, "elementwise a · b with broadcasting (logical and for bool)", _fn("mul"), "normal",
            "normal"),
    "div": (FLOATING_DTYPES, "elementwise true division a / b (integers divide in the default float dtype)", _fn("div"),
            "normal", "nonzero"),
    "pow": (NUMERIC_DTYPES, "elementwise a ** b", _fn("pow"), "base", "exponent"),
    "floor_divide": (NUMERIC_DTYPES, "elementwise floor(a / b), Python's //", _operator("//"), "normal", "nonzero"),
    "remainder": (NUMERIC_DTYPES, "elementwise a − b·floor(a / b), Python's % (sign of b)", _operator("%"), "normal",
                  "nonzero"),
    "maximum": (ALL_DTYPES, "elementwise larger of a and b", _fn("maximum"), "coarse", "coarse"),
    "minimum": (ALL_DTYPES, "elementwise smaller of a and b", _fn("minimum"), "coarse", "coarse"),
    "eq": (ALL_DTYPES, "elementwise a == b (bool result)", _fn("eq"), "coarse", "coarse"),
    "ne": (ALL_DTYPES, "elementwise a != b (bool result)", _fn("ne"), "coarse", "coarse"),
    "lt": (ALL_DTYPES, "elementwise a < b (bool result)", _fn("lt"), "coarse", "coarse"),
    "le": (ALL_DTYPES, "elementwise a <= b (bool result)", _fn("le"), "coarse", "coarse"),
    "gt": (ALL_DTYPES, "elementwise a > b (bool result)", _fn("gt"), "coarse", "coarse"),
    "ge": (ALL_DTYPES, "elementwise a >= b (bool result)", _fn("ge"), "coarse", "coarse"),
    "logical_and": (BOOL, "elementwise a and b of the operands' truth values", _fn("logical_and"), "normal",
                    "normal"),
    "logical_or": (BOOL, "elementwise a or b of the operands' truth values", _fn("logical_or"), "normal",
                   "normal"),
    "logical_xor": (BOOL, "elementwise a xor b of bool tensors (operator ^)", _operator("^"), "normal",
                    "normal"),
    "bitwise_and": (INTEGER_DTYPES, "elementwise bitwise and of integer tensors (operator &)", _operator("&"), "normal",
                    "normal"),
    "bitwise_or": (INTEGER_DTYPES, "elementwise bitwise or of integer tensors (operator |)", _operator("|"), "normal",
                   "normal"),
    "bitwise_xor": (INTEGER_DTYPES, "elementwise bitwise xor of integer tensors (operator ^)", _operator("^"), "normal",
                    "normal"),
}
_SIGNATURES = {"add": "add(input, other, *, alpha=1) -> Tensor", "sub": "sub(input, other, *, alpha=1) -> Tensor",
               "floor_divide": "input // other -> Tensor", "remainder": "input % other -> Tensor",
               "logical_xor": "input ^ other (bool) -> Tensor", "bitwise_and": "input & other -> Tensor",
               "bitwise_or": "input | other -> Tensor", "bitwise_xor": "input ^ other -> Tensor"}


def _binary_sampler(domain_a: str, domain_b: str) -> Callable[[DType], SearchStrategy[Sample]]:
    return lambda dt: binary_samples(dt, domain_a, domain_b)


def _unary_sampler(domain: str) -> Callable[[DType], SearchStrategy[Sample]]:
    return lambda dt: unary_samples(dt, domain)


for _name, (_dtypes, _meaning, _call, _da, _db) in _BINARY.items():
    _op(_name, _SIGNATURES.get(_name, f"{_name}(input, other) -> Tensor"), _meaning, _dtypes,
        _binary_sampler(_da, _db), _call)

_UNARY = {
    # name: (dtypes, meaning, domain)
    "neg": (NUMERIC_DTYPES, "elementwise −x", "normal"),
    "abs": (NUMERIC_DTYPES, "elementwise |x|", "normal"),
    "sign": (NUMERIC_DTYPES, "elementwise sign: −1, 0 or 1", "coarse"),
    "relu": (NUMERIC_DTYPES, "elementwise max(x, 0)", "normal"),
    "exp": (FLOATING_DTYPES, "elementwise eˣ", "exp"),
    "expm1": (FLOATING_DTYPES, "elementwise eˣ − 1, accurate near 0", "exp"),
    "log": (FLOATING_DTYPES, "elementwise natural logarithm", "positive"),
    "log1p": (FLOATING_DTYPES, "elementwise log(1 + x), accurate near 0", "log1p"),
    "sqrt": (FLOATING_DTYPES, "elementwise square root", "positive"),
    "rsqrt": (FLOATING_DTYPES, "elementwise 1 / √x", "positive"),
    "tanh": (FLOATING_DTYPES, "elementwise hyperbolic tangent", "normal"),
    "sin": (FLOATING_DTYPES, "elementwise sine", "normal"),
    "cos": (FLOATING_DTYPES, "elementwise cosine", "normal"),
    "sigmoid": (FLOATING_DTYPES, "elementwise 1 / (1 + e⁻ˣ), without overflow for large |x|", "normal"),
    "silu": (FLOATING_DTYPES, "elementwise x · sigmoid(x)", "normal"),
    "erf": (FLOATING_DTYPES, "elementwise Gauss error function", "normal"),
}
for _name, (_dtypes, _meaning, _domain) in _UNARY.items():
    _op(_name, f"{_name}(input) -> Tensor", _meaning, _dtypes, _unary_sampler(_domain), _fn(_name))
_op("logical_not", "logical_not(input) -> Tensor", "elementwise not of the truth values", BOOL,
    lambda dt: unary_samples(dt), _fn("logical_not"))
_op("bitwise_not", "~input -> Tensor", "elementwise bitwise not of an integer tensor", INTEGER_DTYPES,
    lambda dt: unary_samples(dt), lambda x: ~x)


def _gelu_kwargs(draw: DrawFn) -> dict[str, Any]:
    return {"approximate": draw(_st().sampled_from(("none", "tanh")))}


_op("gelu", "gelu(input, approximate='none') -> Tensor",
    "x·Φ(x) (approximate='none', through erf) or GPT-2's tanh approximation", FLOATING_DTYPES,
    lambda dt: unary_samples(dt, kwargs=_gelu_kwargs), _fn("gelu"))
_op("gelu_backward", "gelu(input, approximate) → backward", "gradient of gelu: dy·dgelu/dx", FLOATING_DTYPES,
    lambda dt: unary_samples(dt, grad=True, kwargs=_gelu_kwargs), _fn("gelu"), backward=True)
_op("where", "where(condition, input, other) -> Tensor",
    "input where condition holds, other elsewhere (three-way broadcasting)", ALL_DTYPES, where_samples,
    _fn("where"))
_op("clamp", "clamp(input, min=None, max=None) -> Tensor", "elementwise min(max(x, min), max)", NUMERIC_DTYPES,
    clamp_samples, _fn("clamp"))
_op("copy", "Tensor.clone() / Tensor.contiguous() -> Tensor",
    "a contiguous copy of any view (transposed, strided, offset, expanded)", ALL_DTYPES,
    lambda dt: unary_samples(dt), lambda x: x.clone())
_op("cast", "Tensor.to(dtype) -> Tensor",
    "elementwise conversion to another dtype (floats truncate toward zero into integers)", ALL_DTYPES,
    cast_samples, lambda x, target: x.to(dtype=target))
_op("full", "full(size, fill_value, *, dtype, device) -> Tensor", "a new tensor with every element fill_value",
    ALL_DTYPES, full_samples, lambda size, value, dtype, device: bt.full(size, value, dtype=dtype, device=device),
    factory=True)
_op("arange", "arange(start, end, step, *, dtype, device) -> Tensor",
    "start, start + step, … up to but not including end", NUMERIC_DTYPES, arange_samples,
    lambda start, end, step, dtype, device: bt.arange(start, end, step, dtype=dtype, device=device), factory=True)
_op("linspace", "linspace(start, end, steps, *, dtype, device) -> Tensor",
    "steps evenly spaced values from start to end inclusive", NUMERIC_DTYPES, linspace_samples,
    lambda start, end, steps, dtype, device: bt.linspace(start, end, steps, dtype=dtype, device=device),
    factory=True)
_op("eye", "eye(n, m, *, dtype, device) -> Tensor", "an n×m matrix with ones on the diagonal", ALL_DTYPES,
    eye_samples, lambda n, m, dtype, device: bt.eye(n, m, dtype=dtype, device=device), factory=True)

_op("sum", "sum(input, dim=None, keepdim=False) -> Tensor",
    "sum over dims (bool and integers accumulate in int64)", ALL_DTYPES, lambda dt: reduction_samples(dt),
    _fn("sum"))
_op("mean", "mean(input, dim=None, keepdim=False) -> Tensor", "arithmetic mean over dims", FLOATING_DTYPES,
    lambda dt: reduction_samples(dt), _fn("mean"))
_op("amax", "amax(input, dim=None, keepdim=False) -> Tensor", "largest element over dims", ALL_DTYPES,
    lambda dt: reduction_samples(dt, "distinct", nonempty=True), _fn("amax"))
_op("amin", "amin(input, dim=None, keepdim=False) -> Tensor", "smallest element over dims", ALL_DTYPES,
    lambda dt: reduction_samples(dt, "distinct", nonempty=True), _fn("amin"))
_op("max_dim", "Tensor.max(dim, keepdim=False) -> (values, indices)",
    "largest element along one dim and where it is", ALL_DTYPES,
    lambda dt: reduction_samples(dt, "distinct", multiple=False, none=False, nonempty=True),
    lambda x, dim, keepdim: tuple(x.max(dim, keepdim)))
_op("min_dim", "Tensor.min(dim, keepdim=False) -> (values, indices)",
    "smallest element along one dim and where it is", ALL_DTYPES,
    lambda dt: reduction_samples(dt, "distinct", multiple=False, none=False, nonempty=True),
    lambda x, dim, keepdim: tuple(x.min(dim, keepdim)))
_op("argmax", "argmax(input, dim=None, keepdim=False) -> Tensor",
    "int64 position of the largest element (over all elements, or along dim)", ALL_DTYPES,
    lambda dt: reduction_samples(dt, "distinct", multiple=False, nonempty=True), _fn("argmax"))
_op("argmin", "argmin(input, dim=None, keepdim=False) -> Tensor",
    "int64 position of the smallest element (over all elements, or along dim)", ALL_DTYPES,
    lambda dt: reduction_samples(dt, "distinct", multiple=False, nonempty=True), _fn("argmin"))


def _correction(draw: DrawFn) -> dict[str, Any]:
    return {"correction": draw(_st().sampled_from((0, 1)))}


def _p(draw: DrawFn) -> dict[str, Any]:
    return {"p": draw(_st().sampled_from((1.0, 2.0, 3.0, float("inf"))))}


_op("var", "var(input, dim=None, *, correction=1, keepdim=False) -> Tensor",
    "variance over dims, divided by count − correction", FLOATING_DTYPES,
    lambda dt: reduction_samples(dt, extra=_correction), _fn("var"))
_op("norm", "norm(input, p=2, dim=None, keepdim=False) -> Tensor", "vector p-norm over dims (p may be inf)",
    FLOATING_DTYPES, lambda dt: reduction_samples(dt, extra=_p), _fn("norm"))
_op("logsumexp", "logsumexp(input, dim, keepdim=False) -> Tensor", "log Σ eˣ over dims, without overflow",
    FLOATING_DTYPES, lambda dt: reduction_samples(dt, none=False), _fn("logsumexp"))
_op("softmax", "softmax(input, dim) -> Tensor", "eˣ / Σ eˣ along dim", FLOATING_DTYPES, lambda dt: dim_samples(dt),
    _fn("softmax"))
_op("log_softmax", "log_softmax(input, dim) -> Tensor", "x − logsumexp(x) along dim", FLOATING_DTYPES,
    lambda dt: dim_samples(dt), _fn("log_softmax"))
_op("softmax_backward", "softmax(input, dim) → backward", "gradient of softmax: y ∘ (dy − Σ dy ∘ y)", FLOATING_DTYPES,
    lambda dt: dim_samples(dt, grad=True), _fn("softmax"), backward=True)
_op("log_softmax_backward", "log_softmax(input, dim) → backward", "gradient of log_softmax: dy − eʸ Σ dy",
    FLOATING_DTYPES, lambda dt: dim_samples(dt, grad=True), _fn("log_softmax"), backward=True)
_op("all", "Tensor.all() -> Tensor", "whether every element is true", BOOL, lambda dt: unary_samples(dt),
    lambda x: x.all())
_op("any", "Tensor.any() -> Tensor", "whether some element is true", BOOL, lambda dt: unary_samples(dt),
    lambda x: x.any())

_op("matmul", "matmul(input, other) -> Tensor",
    "matrix product; 1-D operands are vectors, batch dims broadcast", NUMERIC_DTYPES, lambda dt: matmul_samples(dt),
    _fn("matmul"))
_op("linear", "linear(input, weight, bias=None) -> Tensor", "x Wᵀ + b over the last dim of x", NUMERIC_DTYPES,
    lambda dt: linear_samples(dt), _fn("linear"))
_op("linear_gelu", "linear_gelu(input, weight, bias=None, approximate='tanh') -> Tensor",
    "gelu(x Wᵀ + b) (a GEMM whose epilogue adds the bias and applies GELU)", FLOATING_DTYPES,
    lambda dt: linear_samples(dt, gelu=True), _fn("linear_gelu"))
_op("linear_add", "linear_add(residual, input, weight, bias=None) -> Tensor",
    "residual + x Wᵀ + b in one GEMM (bias and residual added by its epilogue)", FLOATING_DTYPES,
    lambda dt: linear_add_samples(dt), _fn("linear_add"))
_op("linear_backward", "linear(input, weight, bias) → backward", "dx = dy W, dW = dyᵀ x, db = Σ dy", FLOATING_DTYPES,
    lambda dt: linear_samples(dt, grad=True), _fn("linear"), backward=True)

_op("linear_cross_entropy",
    "linear_cross_entropy(input, weight, target, *, ignore_index=-100, reduction='mean', label_smoothing=0.0, "
    "chunk_size=None) -> Tensor",
    "cross_entropy(linear(input, weight), target) a chunk of rows at a time, never holding all logits", FLOATING_DTYPES,
    lambda dt: linear_cross_entropy_samples(dt), _loss_and_grads)

_op("index", "input[key] (integer or bool tensors in key) -> Tensor",
    "gathers the elements an advanced key selects into a new tensor", ALL_DTYPES, getitem_samples, _getitem)
_op("index_put", "input[key] = value; index_put_(input, indices, values, accumulate) -> Tensor",
    "writes value where key selects, in place (accumulate sums repeated indices)", ALL_DTYPES,
    setitem_samples, _setitem)
_op("index_select", "index_select(input, dim, index) -> Tensor", "the slices of input at index along dim",
    ALL_DTYPES, index_select_samples, _fn("index_select"))
_op("gather", "gather(input, dim, index) -> Tensor", "out[i][j] = input[index[i][j]][j] (for dim 0)",
    ALL_DTYPES, gather_samples, _fn("gather"))
_op("scatter_add", "scatter_add(input, dim, index, src) -> Tensor",
    "a copy of input with src added at index along dim (repeats sum)", ALL_DTYPES,
    lambda dt: gather_samples(dt, scatter=True), _fn("scatter_add"))
_op("index_add", "index_add(input, dim, index, source) -> Tensor",
    "a copy of input with source's slices added at index along dim", ALL_DTYPES, index_add_samples,
    _fn("index_add"))
_op("tril", "tril(input, diagonal=0) -> Tensor", "zeros above the diagonal of the last two dims", ALL_DTYPES,
    tri_samples, _fn("tril"))
_op("triu", "triu(input, diagonal=0) -> Tensor", "zeros below the diagonal of the last two dims", ALL_DTYPES,
    tri_samples, _fn("triu"))
_op("cat", "cat(tensors, dim=0) -> Tensor", "joins tensors along an existing dim", ALL_DTYPES, cat_samples,
    lambda *ts, dim: bt.cat(list(ts), dim))
_op("embedding", "embedding(input, weight) -> Tensor", "rows of weight picked by integer ids", ALL_DTYPES,
    lambda dt: embedding_samples(dt), _fn("embedding"))
_op("embedding_backward", "embedding(input, weight) → backward",
    "gradient of embedding: output-gradient rows summed per id", FLOATING_DTYPES,
    lambda dt: embedding_samples(dt, grad=True), _fn("embedding"), backward=True)

_op("layer_norm", "layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5) -> Tensor",
    "(x − mean) / √(var + eps) · weight + bias over the trailing dims", FLOATING_DTYPES,
    lambda dt: norm_layer_samples(dt), _fn("layer_norm"))
_op("layer_norm_backward", "layer_norm(...) → backward", "gradients of layer_norm for input, weight and bias",
    FLOATING_DTYPES, lambda dt: norm_layer_samples(dt, grad=True), _fn("layer_norm"), backward=True)
_op("rms_norm", "rms_norm(input, normalized_shape, weight=None, eps=None) -> Tensor",
    "x / √(mean(x²) + eps) · weight over the trailing dims", FLOATING_DTYPES,
    lambda dt: norm_layer_samples(dt, rms=True), _fn("rms_norm"))
_op("rms_norm_backward", "rms_norm(...) → backward", "gradients of rms_norm for input and weight", FLOATING_DTYPES,
    lambda dt: norm_layer_samples(dt, rms=True, grad=True), _fn("rms_norm"), backward=True)
_op("bias_gelu", "bias_gelu(input, bias, approximate='tanh') -> Tensor",
    "gelu(x + bias), bias over the last dim (a GEMM's bias epilogue fused with the activation)", FLOATING_DTYPES,
    lambda dt: bias_gelu_samples(dt), _fn("bias_gelu"))
_op("bias_gelu_backward", "bias_gelu(...) → backward",
    "dx = dy·gelu'(x + bias); dbias = Σ dx over all but the last dim", FLOATING_DTYPES,
    lambda dt: bias_gelu_samples(dt, grad=True), _fn("bias_gelu"), backward=True)
_op("rope", "rope(q, k, cos, sin) -> (Tensor, Tensor)",
    "rotary embedding of q and k in one kernel, rotate-half: (x₁ cos − x₂ sin, x₂ cos + x₁ sin)", FLOATING_DTYPES,
    lambda dt: rope_samples(dt), _fn("rope"))
_op("rope_backward", "rope(...) → backward", "the gradients of q and k rotated back by the same angles",
    FLOATING_DTYPES, lambda dt: rope_samples(dt, grad=True), _rope_joined, backward=True)
_op("swiglu", "swiglu(gate, up) -> Tensor", "silu(gate) · up (Llama's gated MLP)", FLOATING_DTYPES,
    lambda dt: swiglu_samples(dt), _fn("swiglu"))
_op("swiglu_backward", "swiglu(...) → backward",
    "d gate = dy·up·σ(g)(1 + g(1 − σ(g))), d up = dy·silu(g)", FLOATING_DTYPES,
    lambda dt: swiglu_samples(dt, grad=True), _fn("swiglu"), backward=True)
_op("dropout", "dropout(input, p=0.5, training=True) -> Tensor",
    "zeroes each element with probability p, scales the rest by 1/(1−p)", FLOATING_DTYPES, dropout_samples, _dropout,
    reference=_dropout_reference)
_op("cross_entropy",
    "cross_entropy(input, target, *, ignore_index=-100, reduction='mean', label_smoothing=0.0) -> Tensor",
    "softmax cross-entropy of logits against class ids", FLOATING_DTYPES, lambda dt: cross_entropy_samples(dt),
    _fn("cross_entropy"))
_op("cross_entropy_backward", "cross_entropy(...) → backward",
    "gradient of cross_entropy: softmax − smoothed one-hot, zero on ignored rows", FLOATING_DTYPES,
    lambda dt: cross_entropy_samples(dt, grad=True), _fn("cross_entropy"), backward=True)
_op("sdpa", "scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None)",
    "softmax(q kᵀ·scale + mask) v", FLOATING_DTYPES, lambda dt: sdpa_samples(dt), _sdpa)
_op("sdpa_backward", "scaled_dot_product_attention(...) → backward",
    "gradients of attention for q, k and v (probabilities recomputed from the log-sum-exp)", FLOATING_DTYPES,
    lambda dt: sdpa_samples(dt, grad=True), _sdpa, backward=True)
_op("sdpa_packed", "self_attention(qkv, n_head, is_causal=False, scale=None) -> Tensor",
    "attention of each head of a packed (B, T, 3C) q|k|v projection, heads merged to (B, T, C)", FLOATING_DTYPES,
    lambda dt: sdpa_packed_samples(dt), _fn("self_attention"))
_op("sdpa_packed_backward", "self_attention(...) → backward",
    "the (B, T, 3C) gradient of packed self-attention, one buffer in qkv's dtype", FLOATING_DTYPES,
    lambda dt: sdpa_packed_samples(dt, grad=True), _fn("self_attention"), backward=True)


__all__ = ["CATALOGUE", "LAYOUTS", "Arg", "OpInfo", "Sample", "get_op", "reference_dtype"]
