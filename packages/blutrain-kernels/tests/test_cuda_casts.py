"""casts.cu's conversions between float32, bfloat16 and float16 against NumPy / ml_dtypes, bit for bit.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, dev, rng
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


# float32 <-> bfloat16 <-> float16 must convert exactly as the CPU backend (NumPy / ml_dtypes) does,
# compared bit for bit: rounding ties, subnormals, overflow to inf, signed zeros, NaN signs and payloads.

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
CAST_DTYPES = [F32, BF16, F16]
CAST_PAIRS = [(s, d) for s in CAST_DTYPES for d in CAST_DTYPES if s != d]
UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def pair_id(pair: Any) -> str:
    return f"{pair[0].name}-{pair[1].name}"


def as_bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a.view(UINT[a.dtype.itemsize])


def cast_reference(src: np.ndarray[Any, Any], dtype: Any) -> np.ndarray[Any, Any]:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow flag the CPU's conversion
        return src.astype(dtype)


def assert_cast_matches_numpy(src: np.ndarray[Any, Any], got: Any, dtype: Any) -> None:
    import cupy as cp

    assert got is not None, "the cast kernel declined a contiguous float32/bfloat16/float16 array"
    assert got.dtype == dtype and got.shape == src.shape
    want = as_bits(cast_reference(src, dtype))
    have = as_bits(np.asarray(cp.asnumpy(got)))
    wrong = np.flatnonzero((have != want).reshape(-1))
    if wrong.size:
        i = int(wrong[0])
        s, h, w = (int(x.reshape(-1)[i]) for x in (as_bits(src), have, want))
        raise AssertionError(f"{wrong.size} of {want.size} elements differ from NumPy; first at {i}: source bits "
                             f"{s:#x} -> {h:#x}, NumPy gives {w:#x}")


def cast_patterns(r: np.random.Generator, n: int, dtype: Any) -> np.ndarray[Any, Any]:
    """n values of ``dtype``: random bit patterns (every class: NaNs with payloads, infinities, subnormals,
    zeros) mixed with values of training-like magnitudes from 1e-8 to 1e5."""
    u = UINT[np.dtype(dtype).itemsize]
    out = r.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True).view(dtype)
    plain = r.random(n) < 0.5
    values = r.standard_normal(int(plain.sum())) * 10.0 ** r.uniform(-8, 5, int(plain.sum()))
    with np.errstate(over="ignore"):
        out[plain] = values.astype(np.float32).astype(dtype)
    return out


F32_SPECIALS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # signed zeros, infinities
                0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FBFFFFF, 0x7FFFFFFF, 0x7FA00000,  # NaNs
                0x00000001, 0x807FFFFF, 0x00400000, 0x00800000, 0x80800000,  # subnormals, smallest normals
                0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,  # max finite; round to bf16 max / overflow
                0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000,  # bf16 ties at 1.0
                0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000, 0x47800000,  # 65504, f16 overflow tie, 65536
                0x33000000, 0x33000001, 0x33400000, 0x337FFFFF, 0xB3000000,  # f16 subnormal ties at 2^-25
                0x38800000, 0x387FC000, 0x387FE000, 0x3F801000, 0x3F803000]  # f16 min normal, ties at 1.0


def float32_ties() -> np.ndarray[Any, Any]:
    """Every bfloat16 and float16 rounding tie of float32, each with its neighbours one ulp either side, and
    the special values above."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    bf16_ties = (hi[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)).reshape(-1)
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # every finite float16 >= 0
    above = np.append(h[1:], 65536.0)
    mid = ((h + above) / 2).astype(np.float32)  # exact: 12 significant bits
    f16_ties = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))])
    f16_ties = np.concatenate([f16_ties, -f16_ties]).view(np.uint32)
    return np.concatenate([bf16_ties, f16_ties, np.array(F32_SPECIALS, np.uint32)]).view(np.float32)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=st.sampled_from(CAST_PAIRS),
       n=st.one_of(st.sampled_from([0, 1, 2, 7, 8, 9, 15, 16, 17, 255, 2047, 2048, 2049]), st.integers(0, 70_000)),
       offset=st.integers(0, 9), seed=st.integers(0, 2**32 - 1))
def test_cast_matches_numpy_bit_for_bit_at_any_size_and_offset(pair: Any, n: int, offset: int, seed: int) -> None:
    """offset counts elements into a larger buffer: most offsets leave the source off 16-byte alignment."""
    import cupy as cp

    from blutrain.kernels import cuda

    src_dtype, dst_dtype = pair
    host_buf = cast_patterns(rng(seed), n + offset, src_dtype)
    view = cp.asarray(host_buf)[offset:]
    assert_cast_matches_numpy(host_buf[offset:], cuda.cast(view, dst_dtype), dst_dtype)


@pytest.mark.parametrize("pair", [p for p in CAST_PAIRS if p[0] != F32], ids=pair_id)
def test_cast_of_every_16_bit_pattern_matches_numpy(pair: Any) -> None:
    from blutrain.kernels import cuda

    src_dtype, dst_dtype = pair
    src = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(src_dtype)
    assert_cast_matches_numpy(src, cuda.cast(dev(src), dst_dtype), dst_dtype)
    assert_cast_matches_numpy(src[3:], cuda.cast(dev(src)[3:], dst_dtype), dst_dtype)  # the one-element kernel


@pytest.mark.parametrize("dtype", [BF16, F16], ids=lambda d: d.name)
def test_cast_from_float32_rounds_ties_subnormals_and_overflow_as_numpy(dtype: Any) -> None:
    from blutrain.kernels import cuda

    src = float32_ties()
    assert_cast_matches_numpy(src, cuda.cast(dev(src), dtype), dtype)
    assert_cast_matches_numpy(src[1:], cuda.cast(dev(src)[1:], dtype), dtype)  # the one-element kernel


@pytest.mark.parametrize("pair", CAST_PAIRS, ids=pair_id)
@pytest.mark.parametrize("offset", [0, 1])
def test_cast_over_several_sweeps_of_the_grid(pair: Any, offset: int) -> None:
    """More elements than the grid-stride kernels cover in one pass of the grid (16 blocks of 256 threads per
    multiprocessor, 8 or 4 elements each), plus a tail."""
    import cupy as cp

    from blutrain.kernels import cuda

    src_dtype, dst_dtype = pair
    n = 2 * 16 * cuda.sm_count() * 256 * 8 + 13
    host_buf = cast_patterns(rng(40), n + offset, src_dtype)
    assert_cast_matches_numpy(host_buf[offset:], cuda.cast(cp.asarray(host_buf)[offset:], dst_dtype), dst_dtype)


def test_cast_of_a_fortran_ordered_array_keeps_its_order() -> None:
    from blutrain.kernels import cuda

    src = cast_patterns(rng(41), 33 * 70, F32).reshape(33, 70)
    got = cuda.cast(dev(src).T, BF16)
    assert got is not None and got.flags.f_contiguous
    assert_cast_matches_numpy(src.T, got, BF16)


def test_cast_leaves_strided_views_and_other_dtypes_to_cupy() -> None:
    from blutrain.kernels import cuda

    a = dev(rng(42).standard_normal((8, 16)), np.float32)
    assert cuda.cast(a[:, ::2], BF16) is None
    assert cuda.cast(a, np.float64) is None
    assert cuda.cast(a, np.float32) is None
    assert cuda.cast(a.astype(np.int32), np.float32) is None
