"""The CPU ``cast_multi_tensor`` kernel: a list of arrays of one dtype converted to another, each with the bits
the ``cast`` kernel gives it (the compiler's multi-tensor-cast pass replaces a step's casts with it)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.tensor.dtype import as_dtype
from blutrain.tensor.kernel import kernels

FLOATS = ["float16", "bfloat16", "float32", "float64"]
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a.view(_UINT[a.dtype.itemsize])


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """Random bit patterns of ``dtype`` (NaNs with payloads, infinities, subnormals, zeros of both signs)
    mixed with training-like values from 1e-8 to 1e5."""
    n = int(np.prod(shape))
    u = _UINT[dtype.itemsize]
    out = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True).view(dtype)
    plain = rng.random(n) < 0.5
    with np.errstate(over="ignore"):
        out[plain] = (rng.standard_normal(int(plain.sum())) * 10.0 ** rng.uniform(-8, 5, int(plain.sum()))).astype(
            dtype)
    return out.reshape(shape)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FLOATS), st.sampled_from(FLOATS), st.lists(shapes, min_size=0, max_size=6),
       st.integers(0, 2**32 - 1))
def test_each_result_has_the_bits_of_the_single_cast(source: str, target: str, shape_list: list[tuple[int, ...]],
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    src, dst = as_dtype(source), as_dtype(target)
    arrays = [_values(rng, s, np.dtype(src.np)) for s in shape_list]
    before = [a.copy() for a in arrays]
    single = kernels().lookup("cast", "cpu", src).fn
    with np.errstate(invalid="ignore", over="ignore"):
        got = kernels().lookup("cast_multi_tensor", "cpu", src).fn(arrays, dst.np)
        want = [single(a, dst.np) for a in arrays]
    assert isinstance(got, list) and len(got) == len(arrays)
    for g, w, a, b in zip(got, want, arrays, before, strict=True):
        assert type(g) is np.ndarray and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))
        assert g is not a and not np.shares_memory(g, a)  # a new array, as the cast's
        np.testing.assert_array_equal(_bits(a), _bits(b))  # the sources untouched


def test_float32_to_bfloat16_rounds_ties_to_even_and_quiets_nans_as_the_cast() -> None:
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x7F800001,
                     0xFF812345, 0x7FC00000, 0xFF800000], np.uint32).view(np.float32)
    f32, bf16 = as_dtype("float32"), as_dtype("bfloat16")
    with np.errstate(invalid="ignore", over="ignore"):
        got = kernels().lookup("cast_multi_tensor", "cpu", f32).fn([ties, ties[::-1].copy()], bf16.np)
        want = kernels().lookup("cast", "cpu", f32).fn(ties, bf16.np)
    np.testing.assert_array_equal(_bits(got[0]), _bits(want))
    np.testing.assert_array_equal(_bits(got[1]), _bits(want)[::-1])
