"""half_elementwise.cu's one-launch bfloat16/float16 ops against what they replace, bit for bit: the cuda
backend's generic path for half precision (the cast kernel widens each operand, CuPy's float32 ufunc computes,
the cast kernel narrows), over every class of value (NaNs with payloads, infinities, subnormals, signed zeros)
and every layout the launchers take; and against the float32 op computed on the host with NumPy and rounded
once to nearest even (the exact ops bit for bit, the transcendental ones within one unit in the last place).
Skipped without an NVIDIA GPU and CuPy; helpers: cuda_kernel_checks.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, dev, rng
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

F16 = np.dtype(np.float16)
HALVES = [BF16, F16]
U16 = np.dtype(np.uint16)
ARITHMETIC = ["add", "sub", "mul", "div", "maximum", "minimum", "pow"]
COMPARISONS = ["eq", "ne", "lt", "le", "gt", "ge"]
UNARY = ["neg", "abs", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "tanh", "sin", "cos", "relu"]
# Python operands as the op functions pass them (ints and bools included), and pow's exponents: CuPy's
# ndarray.__pow__ squares for 2, takes sqrt for 0.5 and the reciprocal for -1.0, powf for the rest
SCALARS: list[Any] = [0.0, -0.0, 1.0, -1.5, 2, 3, 0.1, 1e-3, 65504.0, 3.0e38, float("inf"), float("-inf"),
                      float("nan"), True, -7]
EXPONENTS: list[Any] = [2, 2.0, 0.5, -1.0, -1, 3, -2, 1.5, 0.0, True, 1e-3]


def half_id(dtype: Any) -> str:
    return str(np.dtype(dtype).name)


def launcher(op: str) -> Callable[..., Any]:
    from blutrain.kernels import cuda

    fn, names = cuda.KERNELS[op]
    assert names == ("bfloat16", "float16")
    return fn


def generic(op: str, dtype: Any) -> Callable[..., Any]:
    """The generic kernel of ``op`` for ``dtype`` as the cuda backend runs it for half precision: the
    catalogue's function in float32, operands widened and the result narrowed by the cast kernels."""
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.tensor.cpu import TABLE
    from blutrain.tensor.dtype import as_dtype
    from blutrain.tensor.half import HalfPrecision

    def cast(v: Any, dt: Any) -> Any:
        out = cuda.cast(v, dt)
        return v.astype(dt) if out is None else out

    half = HalfPrecision(is_array=lambda v: type(v) is cp.ndarray, cast=cast)
    return half.in_float32(TABLE[op][0], as_dtype(np.dtype(dtype).name))


def bits(a: Any) -> np.ndarray[Any, Any]:
    import cupy as cp

    h = np.asarray(cp.asnumpy(a))
    return h.view(np.uint8) if h.dtype == np.bool_ else h.view(U16)


def assert_same_bits(got: Any, want: Any, what: str) -> None:
    assert got is not None, f"{what}: the one-launch kernel declined a call it covers"
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    g, w = bits(got), bits(want)
    wrong = np.flatnonzero((g != w).reshape(-1))
    if wrong.size:
        i = int(wrong[0])
        raise AssertionError(f"{what}: {wrong.size} of {w.size} elements differ from the generic path; first at "
                             f"{i}: {int(g.reshape(-1)[i]):#x}, the generic path {int(w.reshape(-1)[i]):#x}")


def patterns(r: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
    """Values of ``dtype``: random bit patterns (every class of value) mixed with values of training-like
    magnitudes from 1e-3 to 1e3."""
    n = int(np.prod(shape))
    out = r.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16).view(dtype)
    plain = r.random(n) < 0.6
    k = int(plain.sum())
    out[plain] = (r.standard_normal(k) * 10.0 ** r.uniform(-3, 3, k)).astype(np.float32).astype(dtype)
    return out.reshape(shape)


def operands(layout: str, shape: tuple[int, ...], dtype: Any, r: np.random.Generator, k: int) -> tuple[Any, Any]:
    """(a, b) of one layout the launchers take: ``shape`` is the result's; ``k`` picks the broadcast operand's
    extent (its number of trailing or leading dims) and the Python scalar."""
    a = dev(patterns(r, shape, dtype))
    scalar = SCALARS[k % len(SCALARS)]
    nd = len(shape)
    split = 1 + k % nd
    if layout == "same":
        return a, dev(patterns(r, shape, dtype))
    if layout == "same_unaligned":  # views one element into a buffer: the one-element kernels
        n = int(np.prod(shape))
        buf = dev(patterns(r, (2 * n + 1,), dtype))
        return buf[1:n + 1].reshape(shape), buf[n + 1:].reshape(shape)
    if layout == "scalar":
        return a, scalar
    if layout == "scalar_first":
        return scalar, a
    if layout == "device_scalar":
        return a, dev(patterns(r, (), dtype))
    if layout == "device_scalar_first":
        return dev(patterns(r, (1,) * (k % 2), dtype)), a
    if layout == "rows":  # b is a's trailing dims, with a leading one where b has fewer dims than a
        return a, dev(patterns(r, (1,) * (k % 2 if split < nd else 0) + shape[nd - split:], dtype))
    if layout == "rows_first":
        return dev(patterns(r, shape[nd - split:], dtype)), a
    if layout == "columns":  # b is a's leading dims, trailing ones
        return a, dev(patterns(r, shape[:split] + (1,) * (nd - split), dtype))
    if layout == "columns_first":
        return dev(patterns(r, shape[:split] + (1,) * (nd - split), dtype)), a
    raise AssertionError(layout)


LAYOUTS = ["same", "same_unaligned", "scalar", "scalar_first", "device_scalar", "device_scalar_first", "rows",
           "rows_first", "columns", "columns_first"]
SHAPES = st.tuples(st.lists(st.integers(1, 6), min_size=0, max_size=2),
                   st.sampled_from([1, 3, 8, 16, 24, 33, 64])).map(lambda s: (*s[0], s[1]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(ARITHMETIC + COMPARISONS), dtype=st.sampled_from(HALVES),
       layout=st.sampled_from(LAYOUTS), shape=SHAPES, k=st.integers(0, 60), seed=st.integers(0, 2**32 - 1))
def test_binary_ops_equal_the_generic_path_bit_for_bit(op: str, dtype: Any, layout: str, shape: tuple[int, ...],
                                                       k: int, seed: int) -> None:
    a, b = operands(layout, shape, dtype, rng(seed), k)
    assert_same_bits(launcher(op)(a, b), generic(op, dtype)(a, b), f"{op} {layout}")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(UNARY), dtype=st.sampled_from(HALVES), shape=SHAPES, offset=st.integers(0, 1),
       seed=st.integers(0, 2**32 - 1))
def test_unary_ops_equal_the_generic_path_bit_for_bit(op: str, dtype: Any, shape: tuple[int, ...], offset: int,
                                                      seed: int) -> None:
    n = int(np.prod(shape))
    a = dev(patterns(rng(seed), (n + offset,), dtype))[offset:].reshape(shape)  # offset 1: the one-element kernel
    assert_same_bits(launcher(op)(a), generic(op, dtype)(a), op)


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("exponent", EXPONENTS, ids=repr)
def test_pow_by_a_python_exponent_equals_the_generic_path_bit_for_bit(dtype: Any, exponent: Any) -> None:
    a = dev(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype))
    assert_same_bits(launcher("pow")(a, exponent), generic("pow", dtype)(a, exponent), f"pow {exponent!r}")
    assert_same_bits(launcher("pow")(exponent, a), generic("pow", dtype)(exponent, a), f"{exponent!r} ** a")


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("op", UNARY)
def test_unary_ops_of_every_16_bit_pattern_equal_the_generic_path(dtype: Any, op: str) -> None:
    a = dev(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype))
    assert_same_bits(launcher(op)(a), generic(op, dtype)(a), op)


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("op", ARITHMETIC + COMPARISONS)
def test_binary_ops_of_every_16_bit_pattern_equal_the_generic_path(dtype: Any, op: str) -> None:
    """Every pattern against a random one, and against each Python scalar from either side."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    a = dev(every.view(dtype))
    b = dev(rng(3).permutation(every).view(dtype))
    assert_same_bits(launcher(op)(a, b), generic(op, dtype)(a, b), op)
    for s in SCALARS:
        assert_same_bits(launcher(op)(a, s), generic(op, dtype)(a, s), f"{op} with {s!r}")
        assert_same_bits(launcher(op)(s, a), generic(op, dtype)(s, a), f"{s!r} {op}")


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("layout", ["same", "scalar", "rows", "columns", "same_unaligned"])
def test_ops_over_several_sweeps_of_the_grid(dtype: Any, layout: str) -> None:
    """More elements than one pass of the grid-stride kernels covers (16 blocks of 256 threads per
    multiprocessor, 8 or 4 elements each), plus a tail."""
    from blutrain.kernels import cuda

    shape = (2 * 16 * cuda.sm_count() * 256 * 8 // 64 + 3, 64)
    a, b = operands(layout, shape, dtype, rng(41), 0)
    for op in ("add", "mul", "lt"):
        assert_same_bits(launcher(op)(a, b), generic(op, dtype)(a, b), f"{op} {layout}")
    assert_same_bits(launcher("exp")(a), generic("exp", dtype)(a), "exp")


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
def test_empty_operands_give_empty_results_without_a_launch(dtype: Any) -> None:
    a = dev(np.zeros((0, 8), dtype))
    for got, want in ((launcher("add")(a, a), (0, 8)), (launcher("mul")(a, dev(np.ones((8,), dtype))), (0, 8)),
                      (launcher("gt")(a, 0.5), (0, 8)), (launcher("tanh")(a), (0, 8))):
        assert got is not None and got.shape == want


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
def test_calls_outside_the_kernels_are_declined_for_the_generic_path(dtype: Any) -> None:
    import cupy as cp

    r = rng(5)
    a = dev(patterns(r, (4, 6), dtype))
    add, exp = launcher("add"), launcher("exp")
    declined = [
        add(a.T, a.T),                                       # not C-contiguous
        add(a[:, ::2], dev(patterns(r, (4, 3), dtype))),     # a strided view
        exp(a[:, ::2]),
        add(a, a.astype(np.float32)),                        # operands of different dtypes
        add(a.astype(np.float32), a.astype(np.float32)),     # float32: not a half dtype
        exp(a.astype(np.float32)),
        add(dev(patterns(r, (4, 1), dtype)), dev(patterns(r, (1, 6), dtype))),  # both operands broadcast
        add(dev(patterns(r, (4, 1, 6), dtype)), dev(patterns(r, (4, 5, 6), dtype))[:, :1]),  # a strided view
        add(a, dev(patterns(r, (3, 4, 6), dtype))[0:1]),     # more dims than the other, but one: rows
        add(dev(patterns(r, (2, 3, 4), dtype)), dev(patterns(r, (2, 1, 4), dtype))),  # a middle dim broadcast
        add(a, 2**60),                                       # an int CuPy would round through another path
        add(a, 1e39),                                        # a float beyond float32's range
        add(a, np.float32(1.0)),                             # a NumPy scalar
        add(a, cp.asnumpy(a)),                               # a host array
    ]
    assert [i for i, got in enumerate(declined) if got is not None] == [8]
    assert declined[8] is not None and declined[8].shape == (1, 4, 6)


# ------------------------------------------------------------------------------------------- the host's float32 op

U32 = np.dtype(np.uint32)
MIN_NORMAL = np.float32(2.0**-126)


def round_once(x: np.ndarray[Any, Any], dtype: Any) -> np.ndarray[Any, Any]:
    """float32 -> ``dtype``, round to nearest even (bfloat16 by its bits: the carry of 0x7fff plus the kept
    lowest bit; a NaN becomes the quiet NaN of its sign); NumPy's IEEE conversion for float16."""
    if np.dtype(dtype) == F16:
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(np.float16)
    u = x.view(U32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    r[nan] = (((u[nan] >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)).astype(np.uint16)
    return r.view(BF16)


def flush(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float32 subnormals to zeros of their sign, as the device computes under CuPy's -ftz=true."""
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(x) < MIN_NORMAL, np.copysign(np.float32(0), x), x).astype(np.float32)


def normal_values(r: np.random.Generator, n: int, dtype: Any) -> np.ndarray[Any, Any]:
    """patterns() without float32 subnormal inputs (bfloat16's subnormals are float32's; whether an op flushes
    them is the device's business, checked against the generic path above), with every special value."""
    out = patterns(r, (n,), dtype)
    b = out.view(U16)
    if np.dtype(dtype) == BF16:
        sub = ((b & 0x7F80) == 0) & ((b & 0x7F) != 0)
        b[sub] &= 0x8000
    specials = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.0, 0.5, 65504.0], np.float32)
    with np.errstate(over="ignore"):
        out[: specials.size] = specials.astype(dtype)
    return out


EXACT_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
    "minimum": np.minimum, "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
}
EXACT_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": np.negative, "abs": np.abs, "sqrt": np.sqrt, "rsqrt": lambda x: np.float32(1) / np.sqrt(x),
    "relu": lambda x: np.maximum(x, np.float32(0)),
}
SIGNLESS_ZERO = {"maximum", "minimum", "relu"}  # which zero max(+0, -0) gives is the hardware's choice


def assert_matches_host(got: Any, want32: np.ndarray[Any, Any], dtype: Any, op: str) -> None:
    """``got`` against the host's float32 results ``want32`` rounded once: the same bits, but for a NaN (any
    NaN) and where the float32 result is the smallest normal (whether a result rounded up to it from below
    flushes is the hardware's choice)."""
    import cupy as cp

    have = np.asarray(cp.asnumpy(got))
    if want32.dtype == np.bool_:
        assert np.array_equal(have, want32), op
        return
    want = round_once(flush(want32), dtype)
    h, w = have.view(U16), want.view(U16)
    nan_h, nan_w = np.isnan(have.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert np.array_equal(nan_h, nan_w), f"{op}: NaNs at other places than the host's"
    same = (h == w) | nan_w | (np.abs(want32) == MIN_NORMAL)
    if SIGNLESS_ZERO & set(op.split()):  # op names the call, e.g. "0.0 maximum" for a scalar first operand
        same |= (have.astype(np.float32) == 0) & (want.astype(np.float32) == 0)
    wrong = np.flatnonzero(~same)
    assert not wrong.size, (f"{op}: {wrong.size} of {w.size} differ from NumPy's float32 op rounded once; first "
                            f"at {int(wrong[0])}: {int(h[wrong[0]]):#x}, NumPy {int(w[wrong[0]]):#x}")


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("op", sorted(EXACT_BINARY))
def test_exact_binary_ops_equal_numpys_float32_op_rounded_once(dtype: Any, op: str) -> None:
    r = rng(11)
    a, b = normal_values(r, 4099, dtype), normal_values(r, 4099, dtype)
    b[10:20] = a[:10]  # the specials against each other
    a32, b32 = flush(a.astype(np.float32)), flush(b.astype(np.float32))
    with np.errstate(all="ignore"):
        assert_matches_host(launcher(op)(dev(a), dev(b)), EXACT_BINARY[op](a32, b32), dtype, op)
        for s in SCALARS:
            s32 = flush(np.array([s], np.float32))[0]
            assert_matches_host(launcher(op)(dev(a), s), EXACT_BINARY[op](a32, s32), dtype, f"{op} {s!r}")
            assert_matches_host(launcher(op)(s, dev(a)), EXACT_BINARY[op](s32, a32), dtype, f"{s!r} {op}")


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("op", sorted(EXACT_UNARY))
def test_exact_unary_ops_equal_numpys_float32_op_rounded_once(dtype: Any, op: str) -> None:
    a = normal_values(rng(12), 4099, dtype)
    with np.errstate(all="ignore"):
        want = EXACT_UNARY[op](flush(a.astype(np.float32))).astype(np.float32)
    assert_matches_host(launcher(op)(dev(a)), want, dtype, op)


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
def test_pow_by_two_squares_and_by_a_half_takes_the_square_root_exactly(dtype: Any) -> None:
    a = normal_values(rng(13), 4099, dtype)
    a32 = flush(a.astype(np.float32))
    with np.errstate(all="ignore"):
        for exponent, want in ((2, a32 * a32), (2.0, a32 * a32), (0.5, np.sqrt(a32)),
                               (-1.0, np.float32(1) / a32)):
            assert_matches_host(launcher("pow")(dev(a), exponent), want, dtype, f"pow {exponent!r}")


def ordered(h: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """16-bit float patterns as integers in the order of their values (both zeros 0)."""
    u = h.view(U16).astype(np.int64)
    return np.where(u & 0x8000, -(u & 0x7FFF), u)


TRANSCENDENTAL: dict[str, tuple[Callable[[Any], Any], float, float]] = {  # op -> (float64 function, domain)
    "exp": (np.exp, -10.0, 10.0), "expm1": (np.expm1, -10.0, 10.0), "log": (np.log, 1e-3, 1e3),
    "log1p": (np.log1p, -0.9, 1e3), "tanh": (np.tanh, -10.0, 10.0), "sin": (np.sin, -100.0, 100.0),
    "cos": (np.cos, -100.0, 100.0),
}


@pytest.mark.parametrize("dtype", HALVES, ids=half_id)
@pytest.mark.parametrize("op", [*sorted(TRANSCENDENTAL), "pow"])
def test_transcendental_ops_are_within_one_unit_in_the_last_place_of_float64(dtype: Any, op: str) -> None:
    """CUDA's float32 functions are within a few float32 ulps, so rounded to 8 or 11 bits they are at most one
    ulp of the half type from the correctly rounded result."""
    r = rng(14)
    if op == "pow":
        a = r.uniform(0.05, 20.0, 4096).astype(np.float32).astype(dtype)
        b = r.uniform(-3.0, 3.0, 4096).astype(np.float32).astype(dtype)
        ref = np.power(a.astype(np.float64), b.astype(np.float64))
        got = launcher("pow")(dev(a), dev(b))
    else:
        fn, lo, hi = TRANSCENDENTAL[op]
        a = r.uniform(lo, hi, 4096).astype(np.float32).astype(dtype)
        ref = fn(a.astype(np.float64))
        got = launcher(op)(dev(a))
    import cupy as cp

    have = np.asarray(cp.asnumpy(got))
    with np.errstate(over="ignore"):
        want = round_once(flush(ref.astype(np.float32)), dtype)
    assert np.isfinite(want.astype(np.float32)).all()
    off = np.abs(ordered(have) - ordered(want))
    assert off.max() <= 1, f"{op}: {int((off > 1).sum())} results more than one ulp from float64"
