"""casts.cu's multi-tensor kernels (``cast_multi_tensor``) against the single-tensor cast kernel (``cast``), bit
for bit: every pair of float32, bfloat16 and float16, sizes around the 4096-element tile and off multiples of
8, sources off 16-byte alignment, NaNs with payloads, infinities, subnormals, rounding ties; views the kernel
leaves to the single cast; a captured CUDA graph. Every device allocation starts as 0xFF bytes, so an element
the kernel forgets to write differs from the single cast's. Skipped without an NVIDIA GPU and CuPy.
"""

from __future__ import annotations

import itertools
from typing import Any

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

F32, BF16, F16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
PAIRS = [(s, d) for s in (F32, BF16, F16) for d in (F32, BF16, F16) if s != d]
UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
# around the tile (4096) and its vectors (8): odd sizes, tails of 1-7 elements, one and several tiles, empty
SIZES = [1, 2, 3, 7, 8, 9, 15, 17, 255, 4095, 4096, 4097, 4103, 8191, 8192, 8193, 0, 10_007, 50_304, 3 * 4096 + 5]


def pair_id(pair: Any) -> str:
    return f"{pair[0].name}-{pair[1].name}"


def bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a.view(UINT[a.dtype.itemsize])


def patterns(rng: np.random.Generator, n: int, dtype: Any) -> np.ndarray[Any, Any]:
    """n values of ``dtype``: random bit patterns (NaNs with payloads, infinities, subnormals, signed zeros)
    mixed with values of training-like magnitudes from 1e-8 to 1e5."""
    u = UINT[np.dtype(dtype).itemsize]
    out = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True).view(dtype)
    plain = rng.random(n) < 0.5
    values = rng.standard_normal(int(plain.sum())) * 10.0 ** rng.uniform(-8, 5, int(plain.sum()))
    with np.errstate(over="ignore"):
        out[plain] = values.astype(np.float32).astype(dtype)
    return out


def float32_specials() -> np.ndarray[Any, Any]:
    """Every bfloat16 rounding tie of float32 with its neighbours one ulp either side (all exponents, both
    signs, NaN and infinity patterns included), and float16's ties, overflow and subnormal boundaries."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    bf16 = (hi[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)).reshape(-1)
    f16 = np.array([0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000, 0x47800000, 0x33000000, 0x33000001,
                    0x33400000, 0x337FFFFF, 0xB3000000, 0x38800000, 0x387FC000, 0x387FE000, 0x3F801000,
                    0x3F803000, 0x00000001, 0x807FFFFF, 0x7F800001, 0xFF812345, 0x7FA00000], np.uint32)
    return np.concatenate([bf16, f16]).view(np.float32)


def assert_same_as_single_cast(sources: list[Any], got: list[Any], dtype: Any) -> None:
    """Each result equals the single cast kernel's (CuPy's astype where that declines) and NumPy's, bit for
    bit, in dtype, shape and memory order."""
    import cupy as cp

    from blutrain.kernels import cuda

    assert isinstance(got, list) and len(got) == len(sources)
    for i, (a, g) in enumerate(zip(sources, got, strict=True)):
        single = cuda.cast(a, dtype)
        want = a.astype(dtype) if single is None else single
        assert g.dtype == want.dtype and g.shape == want.shape, i
        assert (g.flags.c_contiguous, g.flags.f_contiguous) == (want.flags.c_contiguous, want.flags.f_contiguous), i
        have, expect = bits(cp.asnumpy(g)), bits(cp.asnumpy(want))
        with np.errstate(invalid="ignore", over="ignore"):
            cpu = bits(cp.asnumpy(a).astype(dtype))
        wrong = np.flatnonzero((have != expect).reshape(-1))
        if wrong.size:
            k = int(wrong[0])
            src = int(bits(np.ascontiguousarray(cp.asnumpy(a))).reshape(-1)[k])
            raise AssertionError(f"tensor {i} (shape {a.shape}): {wrong.size} of {have.size} elements differ from "
                                 f"the single cast; first at {k}: source bits {src:#x} -> {int(have.reshape(-1)[k]):#x}"
                                 f", the cast gives {int(expect.reshape(-1)[k]):#x}")
        if single is not None:  # CuPy's astype (strided views) keeps other NaN payloads than NumPy's cast
            np.testing.assert_array_equal(have, cpu)


def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels casts.cu's launcher starts from now on (the test's calls)."""
    from blutrain.kernels.cuda import _casts

    names: list[str] = []
    launch = _casts._launch

    def counting(family: str, name: str, *args: Any, **kwargs: Any) -> None:
        names.append(name)
        launch(family, name, *args, **kwargs)

    monkeypatch.setattr(_casts, "_launch", counting)
    return names


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_every_tensor_equals_its_single_cast_bit_for_bit_in_one_launch(pair: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes around the tile and off multiples of 8 (an empty one among them), random bit patterns: one launch
    of the pair's multi-tensor kernel converts all of them as the single cast does."""
    import cupy as cp

    from blutrain.kernels import cuda

    src, dst = pair
    rng = np.random.default_rng(0)
    sources = [cp.asarray(patterns(rng, n, src)) for n in SIZES]
    names = launches(monkeypatch)
    got = cuda.cast_multi_tensor(sources, dst)
    short = {F32: "f32", BF16: "bf16", F16: "f16"}
    assert names == [f"cast_{short[src]}_{short[dst]}_multi_tensor"]  # the empty one needs no launch
    assert_same_as_single_cast(sources, got, dst)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=lambda d: d.name)
def test_float32_ties_nans_infinities_and_subnormals_round_as_the_single_cast(dtype: Any) -> None:
    """Every bfloat16 tie of float32 and float16's boundaries (NaN -> the quiet NaN of its sign for bf16,
    NumPy's payload rule for f16), split into tensors of odd sizes, one of them off 16-byte alignment."""
    import cupy as cp

    from blutrain.kernels import cuda

    values = cp.asarray(float32_specials())
    cuts = [0, 1, 8, 4097, 70_001, 200_003, values.size]
    sources = [values[a:b] for a, b in itertools.pairwise(cuts)]  # 1, 7, 4089, ... elements
    assert any(s.data.ptr % 16 for s in sources)
    assert_same_as_single_cast(sources, cuda.cast_multi_tensor(sources, dtype), dtype)


@pytest.mark.parametrize("pair", [(F32, BF16), (F32, F16), (BF16, F32)], ids=pair_id)
@pytest.mark.parametrize("offset", range(1, 8))
def test_sources_off_16_byte_alignment_mixed_with_aligned_ones(pair: Any, offset: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Views starting ``offset`` elements into their buffer (off 16-byte alignment unless offset x itemsize is a
    multiple of 16) take the one-element path of the same launch as the aligned tensors beside them."""
    import cupy as cp

    from blutrain.kernels import cuda

    src, dst = pair
    rng = np.random.default_rng(offset)
    base = cp.asarray(patterns(rng, 3 * 4096 + 40, src))
    sources = [cp.asarray(patterns(rng, 4101, src)), base[offset:offset + 9000], cp.asarray(patterns(rng, 13, src)),
               base[offset + 9000:]]
    names = launches(monkeypatch)
    got = cuda.cast_multi_tensor(sources, dst)
    assert len(names) == 1 and names[0].endswith("_multi_tensor")
    assert_same_as_single_cast(sources, got, dst)


def test_strided_and_fortran_ordered_views_convert_as_the_single_cast_beside_the_launch() -> None:
    """Views the multi-tensor kernel does not take (F-ordered, strided, a transposed 2-d) go through the single
    cast or CuPy's astype, with the single cast's memory order; the contiguous ones still convert together."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(3)
    m = cp.asarray(patterns(rng, 33 * 70, F32).reshape(33, 70))
    sources = [m, m.T, m[:, ::3], cp.asfortranarray(m), cp.asarray(patterns(rng, 4099, F32)), m[5]]
    assert_same_as_single_cast(sources, cuda.cast_multi_tensor(sources, BF16), BF16)


def test_many_small_tensors_find_their_tiles() -> None:
    """300 tensors of 0 to 9000 elements (GPT-2's weights and biases in one call, and more): the binary search
    over the first blocks gives each tile its tensor."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(4)
    sizes = rng.integers(0, 9000, 300)
    sizes[::7] = rng.integers(0, 9, sizes[::7].size)
    sources = [cp.asarray(patterns(rng, int(n), F32)) for n in sizes]
    assert_same_as_single_cast(sources, cuda.cast_multi_tensor(sources, BF16), BF16)


def test_a_captured_graph_converts_each_replays_source_values() -> None:
    """Captured once (the table uploaded outside the capture, kept for the graph): each replay converts the
    values the sources hold when it runs."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(5)
    sources = [cp.asarray(patterns(rng, n, F32)) for n in (5, 4097, 9000, 1)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        # an eager call first leaves the results' blocks in the pool of this stream: the capture's allocations
        # are then served from it, with no cudaMalloc while capturing
        outs_eager = cuda.cast_multi_tensor(sources, BF16)
        stream.synchronize()
        del outs_eager
        stream.begin_capture()
        outs = cuda.cast_multi_tensor(sources, BF16)
        graph = stream.end_capture()
        for _ in range(2):
            for s in sources:
                s[...] = cp.asarray(patterns(rng, s.size, F32))
            graph.launch(stream)
            stream.synchronize()
            assert_same_as_single_cast(sources, outs, BF16)


def test_no_arrays_give_no_results_and_mixed_dtypes_are_refused() -> None:
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.tensor.errors import TensorTypeError

    assert cuda.cast_multi_tensor([], BF16) == []
    with pytest.raises(TensorTypeError, match="array 1 must be a CuPy array of dtype float32 like array 0, got "
                                              "ndarray bfloat16"):
        cuda.cast_multi_tensor([cp.ones(4, F32), cp.ones(4, BF16)], F16)


def test_the_cuda_device_registers_it_for_float32_bfloat16_and_float16_sources() -> None:
    from blutrain.kernels import cuda
    from blutrain.tensor.dtype import as_dtype
    from blutrain.tensor.kernel import kernels

    for name in ("float32", "bfloat16", "float16"):
        assert kernels().lookup("cast_multi_tensor", "cuda", as_dtype(name)).fn is cuda.cast_multi_tensor
