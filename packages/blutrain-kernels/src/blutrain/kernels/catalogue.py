"""The op catalogue: every kernel op a device implements, what it means, and how it is tested.

An op here is a kernel name of the registry (``blutrain_register_kernels``): the contract a backend
plugin fills. Each :class:`OpInfo` says how a user reaches the op (``signature``, through the public
API of ``blutrain.tensor``), which compute dtypes a device must support, what it means in one line,
how to draw inputs for it (``samples``: hypothesis strategies, one per dtype) and how to call it
(``call``: the public op on tensors; the conformance suite calls it once on the device under test
and once on float64 CPU tensors, the reference). Backward kernels have no public function of their
own: they are reached through ``Tensor.backward`` and their entries compare input gradients.

How inputs are drawn (:class:`Arg`, :class:`Sample` and one sampler per argument pattern) is
:mod:`blutrain.kernels.samples`; the catalogue names each entry's sampler. Importing either needs NumPy alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blutrain.tensor as bt
from blutrain.kernels.samples import (
    LAYOUTS,
    Arg,
    Sample,
    arange_samples,
    bias_gelu_samples,
    binary_samples,
    cast_samples,
    cat_samples,
    clamp_samples,
    cross_entropy_samples,
    dim_samples,
    dropout_samples,
    embedding_samples,
    eye_samples,
    full_samples,
    gather_samples,
    getitem_samples,
    index_add_samples,
    index_select_samples,
    linear_add_samples,
    linear_cross_entropy_samples,
    linear_samples,
    linspace_samples,
    matmul_samples,
    norm_layer_samples,
    reduction_samples,
    reference_dtype,
    rope_samples,
    sdpa_packed_samples,
    sdpa_samples,
    setitem_samples,
    strategies,
    swiglu_samples,
    tri_samples,
    unary_samples,
    where_samples,
)
from blutrain.tensor.dtype import (
    ALL_DTYPES,
    FLOATING_DTYPES,
    INTEGER_DTYPES,
    NUMERIC_DTYPES,
    DType,
    bool_,
    float64,
)
from blutrain.tensor.tensor import Tensor

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn, SearchStrategy

BOOL: tuple[DType, ...] = (bool_,)


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
    return {"approximate": draw(strategies().sampled_from(("none", "tanh")))}


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
    return {"correction": draw(strategies().sampled_from((0, 1)))}


def _p(draw: DrawFn) -> dict[str, Any]:
    return {"p": draw(strategies().sampled_from((1.0, 2.0, 3.0, float("inf"))))}


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
_op("sdpa", "scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, "
    "enable_gqa=False)",
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
