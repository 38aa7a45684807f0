"""Fused regions across dtypes on CUDA: the generated kernel's conversions between float32, bfloat16,
float16 and float64 give NumPy's and ml_dtypes' bits (float64 → bfloat16: those of the eager cast, CuPy's), and
a compiled mix of half, float32 and float64 ops and casts gives the bits of the same ops run eagerly on the GPU
(CPU twins in test_fusion_dtypes.py)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.dialect import is_kernel, kernel_name
from blutrain.compiler.graph import body

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # NumPy on the specials

BF16 = np.dtype(ml_dtypes.bfloat16)


def _cuda() -> None:
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")


def _convert(in_type: str, out_type: str, expr: str, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``expr`` of ``x`` (named ``x`` there) through an elementwise kernel with the codegen's conversions."""
    import cupy

    from blutrain.compiler.codegen_cuda import PREAMBLE

    kernel = cupy.ElementwiseKernel(f"{in_type} x", f"{out_type} y", f"y = {expr};", "bt_test_convert",
                                    preamble=PREAMBLE)
    return cupy.asnumpy(kernel(cupy.asarray(x)))




def _all_16_bit_patterns() -> np.ndarray[Any, Any]:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


# float32 bit patterns at the edges of the conversions: zeros, float32 subnormals (smallest, largest),
# values halfway between two bfloat16 (ties to the even one: down from an even, up from an odd), just
# above and below a tie, the largest finite float32 (rounds to inf in bfloat16), infinities, quiet and
# signalling NaNs of both signs
_F32_EDGES = np.array([
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007fffff, 0x00008000, 0x00018000, 0x00010000,
    0x3f808000, 0x3f818000, 0xbf808000, 0xbf818000, 0x3f808001, 0x3f807fff, 0x3f80ffff, 0x00800000,
    0x0080ffff, 0x7f7f7fff, 0x7f7f8000, 0x7f7fffff, 0xff7fffff, 0x7f800000, 0xff800000, 0x7fc00000,
    0xffc00000, 0x7f800001, 0xff800001, 0x7fffffff, 0x7fa00000, 0x387fc000, 0x33000000, 0x33000001,
    0x477ff000, 0x477fefff, 0x477fe000, 0x38800000, 0x387fffff,
], dtype=np.uint32)


def _f32_samples() -> np.ndarray[Any, Any]:
    """The edges and a million random float32 bit patterns (every exponent, NaN payloads)."""
    rng = np.random.default_rng(0)
    return np.concatenate([_F32_EDGES, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)]
                          ).view(np.float32)


def test_bfloat16_to_float32_is_exact_for_every_bit_pattern(same_bits: Any) -> None:
    _cuda()
    h = _all_16_bit_patterns()
    got = _convert("uint16", "float32", "bt_bf16_to_f32(x)", h)
    same_bits(got, h.view(BF16).astype(np.float32))


def test_float32_to_bfloat16_rounds_to_nearest_even_as_ml_dtypes() -> None:
    """±0, subnormals, ties to even both ways, overflow to inf, infinities and NaNs (quiet, of their sign)."""
    _cuda()
    x = _f32_samples()
    got = _convert("float32", "uint16", "bt_f32_to_bf16(x)", x)
    np.testing.assert_array_equal(got, x.astype(BF16).view(np.uint16))
    # the ties by hand: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (rounds to 1, even); 1 + 3·2^-8 rounds up
    assert [hex(v) for v in got[8:12]] == ["0x3f80", "0x3f82", "0xbf80", "0xbf82"]
    assert hex(got[19]) == "0x7f80"  # the largest float32 is past bfloat16's largest finite: inf
    assert [hex(v) for v in got[23:27]] == ["0x7fc0", "0xffc0", "0x7fc0", "0xffc0"]  # NaNs: quiet, signed


def test_float16_conversions_match_numpy_and_ml_dtypes_for_every_bit_pattern(same_bits: Any) -> None:
    _cuda()
    h = _all_16_bit_patterns()
    same_bits(_convert("uint16", "float32", "bt_f16_to_f32(x)", h), h.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(_convert("uint16", "uint16", "bt_bf16_to_f16(x)", h),
                                  h.view(BF16).astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(_convert("uint16", "uint16", "bt_f16_to_bf16(x)", h),
                                  h.view(np.float16).astype(BF16).view(np.uint16))
    x = _f32_samples()
    np.testing.assert_array_equal(_convert("float32", "uint16", "bt_f32_to_f16(x)", x),
                                  x.astype(np.float16).view(np.uint16))


def test_float64_to_half_conversions_match_the_eager_casts() -> None:
    """float64 → float16 in one rounding, as NumPy converts; float64 → bfloat16 through float32, as CuPy's
    astype (the eager cast for that pair) converts: CuPy compiles with -ftz=true, so a value that is subnormal
    in float32 becomes a zero of its sign there, where ml_dtypes on the CPU keeps it."""
    _cuda()
    import cupy

    x = np.concatenate([_f32_samples().astype(np.float64),
                        np.array([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-30, 2**-25 + 2**-60, 65520.0, -65519.99,
                                  1e-320, -0.0, 1e-40, -3e-39])])
    x = x[~np.isnan(x)]  # NaNs: below
    np.testing.assert_array_equal(_convert("float64", "uint16", "bt_f64_to_f16(x)", x),
                                  x.astype(np.float16).view(np.uint16))
    to_bf16 = _convert("float64", "uint16", "bt_f32_to_bf16((float)x)", x)
    np.testing.assert_array_equal(to_bf16, cupy.asnumpy(cupy.asarray(x).astype(BF16)).view(np.uint16))
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(to_bf16[normal], x[normal].astype(BF16).view(np.uint16))  # ml_dtypes' too
    nans = np.array([np.nan, -np.nan])
    assert [hex(v) for v in _convert("float64", "uint16", "bt_f64_to_f16(x)", nans)] == ["0x7e00", "0xfe00"]
    assert [hex(v) for v in _convert("float64", "uint16", "bt_f32_to_bf16((float)x)", nans) & 0x7fc0] == \
        ["0x7fc0", "0x7fc0"]  # a quiet NaN


# -- compiled regions against eager kernels on the GPU ------------------------------------------------------

_SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 3.3895e38, 65504.0, 7e4,
                     1.00390625, 1.01171875, 6e-8], np.float64)


def _values(shape: tuple[int, ...], seed: int, dtype: Any) -> np.ndarray[Any, Any]:
    v = np.random.default_rng(seed).standard_normal(shape) * 4.0
    flat = v.reshape(-1)
    n = min(flat.size, _SPECIAL.size)
    flat[:n] = _SPECIAL[:n]
    return v.astype(dtype)


def _on_cuda(*arrays: np.ndarray[Any, Any]) -> list[bt.Tensor]:
    return [bt.from_numpy(a).to("cuda") for a in arrays]


def _host(result: Any) -> list[np.ndarray[Any, Any]]:
    return [t.cpu().numpy() for t in (result if isinstance(result, tuple) else (result,))]


def _compiled_and_eager(f: Any, args: list[bt.Tensor]) -> tuple[list[Any], list[Any], Any]:
    fn = bc.compile(f, warmup=0)
    fn(*args)  # traced
    got = fn(*args)  # replayed: the fused regions' kernels
    return _host(got), _host(f(*args)), fn


_ARGS: dict[str, list[tuple[Any, ...]]] = {
    "add": [(1.25,)], "sub": [(0.75,)], "mul": [(3.0,)], "div": [(7.0,)],
    "pow": [(2,), (2.0,), (0.5,), (-1.0,), (-1,), (3.0,), (1.0,), (0.0,), (-0.5,)],  # CuPy's ``**`` fast paths
    "maximum": [(0.5,)], "minimum": [(-0.5,)]}
_UNARY = ("neg", "exp", "log", "sqrt", "tanh", "abs")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_each_elementwise_op_in_each_float_dtype_gives_the_eager_bits_on_cuda(dtype: str, same_bits: Any) -> None:
    """One region: the input cast to ``dtype`` (through the eager cast kernels' own pairs), then every op with
    a tensor (broadcast) and with scalars, results in ``dtype``, NaNs and infinities among the inputs."""
    _cuda()
    src = np.float64 if dtype == "float32" else np.float32

    def f(x: bt.Tensor, y: bt.Tensor) -> tuple[bt.Tensor, ...]:
        a, b = x.to(dtype), y.to(dtype)
        outs = [getattr(a, name)() for name in _UNARY]
        for name, scalars in _ARGS.items():
            outs.append(getattr(a, name)(b))
            outs += [getattr(a, name)(*s) for s in scalars]
        outs += [1.5**a, 1.5 - a, 2.0 / a]  # a scalar first
        return tuple(outs)

    got, expected, fn = _compiled_and_eager(f, _on_cuda(_values((64, 33), 0, src), _values((33,), 1, src)))
    assert "blutrain.fused" in fn.ir()
    for g, e in zip(got, expected, strict=True):
        same_bits(g, e)


def test_a_float32_region_is_bit_identical_to_its_ops_no_fma_contraction(same_bits: Any) -> None:
    """``x * y + z`` as two kernels rounds the product; a contracted FMA would not."""
    _cuda()
    rng = np.random.default_rng(0)
    args = _on_cuda(*(rng.standard_normal((256, 129)).astype(np.float32) for _ in range(3)))
    got, expected, fn = _compiled_and_eager(lambda x, y, z: (x * y + z) * y - x, args)
    assert "blutrain.fused" in fn.ir()
    same_bits(got[0], expected[0])


def _bf16_step(x: bt.Tensor, w: bt.Tensor, g: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
    """The autocast pattern: bfloat16 activations and gradients, float32 master values."""
    h = (x.float() * w + 0.5).bfloat16()  # cast, float32 mul (w broadcast) and add, cast
    act = (h * x).tanh() - x  # bfloat16 ops
    grad = g.float() + act.float() * 0.125  # casts into a float32 accumulation
    return act, grad


def test_a_compiled_bfloat16_and_float32_mix_gives_the_eager_bits_on_cuda(same_bits: Any) -> None:
    _cuda()
    args = _on_cuda(_values((128, 96), 0, BF16), _values((96,), 1, np.float32), _values((128, 96), 2, BF16))
    got, expected, fn = _compiled_and_eager(_bf16_step, args)
    module = bc.parse(fn.ir())
    assert [kernel_name(o) for o in body(module).ops if is_kernel(o)] == []  # one region holds every op
    for g, e in zip(got, expected, strict=True):
        same_bits(g, e)


def _four_dtypes(x: bt.Tensor, y: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor, bt.Tensor]:
    a = x.float() * y + 1.5
    c = (a.bfloat16() * x - 0.25).exp()
    d = c.half().maximum(x.half()).sqrt()
    e = d.double().log() - a.double().tanh()
    return c.float() + a, d, e


def test_a_compiled_mix_of_all_four_float_dtypes_gives_the_eager_values_on_cuda(as_bits: Any) -> None:
    """Bits for every value but NaNs, which must be NaNs of the same sign: the eager float16 → float64 cast is
    CuPy's astype, whose NaN payload is the hardware's."""
    _cuda()
    got, expected, _ = _compiled_and_eager(_four_dtypes, _on_cuda(_values((64, 40), 0, BF16),
                                                                   _values((40,), 1, np.float32)))
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g.astype(np.float64), e.astype(np.float64))
        np.testing.assert_array_equal(np.signbit(g), np.signbit(e))
        keep = ~np.isnan(e)
        np.testing.assert_array_equal(as_bits(g)[keep], as_bits(e)[keep])
