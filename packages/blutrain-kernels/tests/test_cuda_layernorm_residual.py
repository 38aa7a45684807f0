"""layernorm.cu's residual forward (``layernorm_fwd_res_*``, the compiler's layernorm-residual pass) against
float64 and, bit for bit, against the separate float32 add and LayerNorm kernels it stands for. Outputs land in
poisoned memory (0xFF bytes: NaN), so an element the kernel forgets to write fails. Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
# C a multiple of 4 (the VEC 4 kernels, GPT-2's 768 among them) and not (the VEC 1 kernels); rows over one block
SHAPES = [((5, 768), 1), ((16, 64, 768), 1), ((7, 100), 1), ((3, 33), 1), ((4, 6, 10), 2), ((2, 4096), 1),
          ((3, 5000), 1), ((300, 3072), 1)]


def _inputs(seed: int, shape: tuple[int, ...], k: int, x_dtype: Any, affine: bool) -> tuple[Any, ...]:
    """Device x (the projection, x_dtype), r (the float32 stream), w, b (float32 or None) and their host copies."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    ns = shape[len(shape) - k:]
    hx = (rng.standard_normal(shape) * 0.5).astype(x_dtype)
    hr = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    hw, hb = ((rng.standard_normal(ns).astype(np.float32) if affine else None) for _ in range(2))
    dev = [None if a is None else cp.asarray(a) for a in (hx, hr, hw, hb)]
    return (*dev, hx, hr, hw, hb)


def _bits(a: Any) -> Any:
    import cupy as cp

    h = np.asarray(cp.asnumpy(a))
    return h.view({2: np.uint16, 4: np.uint32}[h.dtype.itemsize])


@pytest.mark.parametrize(("shape", "k"), SHAPES)
@pytest.mark.parametrize("x_dtype", [BF16, F32], ids=["x-bf16", "x-f32"])
@pytest.mark.parametrize("out_dtype", [None, BF16], ids=["y-f32", "y-bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_residual_layernorm_is_the_add_then_the_layernorm_bit_for_bit(shape: tuple[int, ...], k: int, x_dtype: Any,
                                                                      out_dtype: Any, affine: bool) -> None:
    """s is cuda.add(r, x widened by cuda.cast) and y, mean, rstd are cuda.layer_norm's of that sum (with the
    same out_dtype): the same bits, the fresh sum's vector width and thread count being the ones the fused
    kernel takes."""
    from blutrain.kernels import cuda

    x, r, w, b, *_ = _inputs(1, shape, k, x_dtype, affine)
    got = cuda.layer_norm(x, w, b, 1e-5, k, out_dtype, residual=r)
    assert got is not None and len(got) == 4
    y, mean, rstd, s = got
    wide = x if x_dtype == F32 else cuda.cast(x, F32)
    assert wide is not None
    s_ref = r + wide  # one float32 add, correctly rounded by whichever kernel makes it (the residual first)
    ref = cuda.layer_norm(s_ref, w, b, 1e-5, k, out_dtype)
    assert ref is not None
    assert s.dtype == F32 and y.dtype == (F32 if out_dtype is None else out_dtype)
    assert s.shape == y.shape == x.shape and mean.shape == rstd.shape == x.shape[: x.ndim - k]
    for g, want in ((s, s_ref), (y, ref[0]), (mean, ref[1]), (rstd, ref[2])):
        np.testing.assert_array_equal(_bits(g), _bits(want))


@pytest.mark.parametrize(("shape", "k"), SHAPES)
@pytest.mark.parametrize("out_dtype", [None, BF16], ids=["y-f32", "y-bf16"])
def test_residual_layernorm_matches_float64(shape: tuple[int, ...], k: int, out_dtype: Any) -> None:
    """bf16 x, float32 r: s within float32's rounding of the float64 sum, y within 1e-5 (float32 y) or 1e-2
    (bf16 y) relative error of the float64 LayerNorm of the float64 sum; statistics within 1e-5."""
    import cupy as cp

    from blutrain.kernels import cuda

    x, r, w, b, hx, hr, hw, hb = _inputs(2, shape, k, BF16, True)
    got = cuda.layer_norm(x, w, b, 1e-5, k, out_dtype, residual=r)
    assert got is not None
    y, mean, rstd, s = (np.asarray(cp.asnumpy(a)).astype(np.float64) for a in got)
    s64 = hr.astype(np.float64) + hx.astype(np.float64)
    C = int(np.prod(shape[len(shape) - k:]))
    rows = s64.reshape(-1, C)
    m = rows.mean(axis=1, keepdims=True)
    rs = 1 / np.sqrt(((rows - m) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    y64 = ((rows - m) * rs).reshape(shape) * hw.astype(np.float64) + hb.astype(np.float64)

    def rel(a: Any, ref: Any) -> float:
        assert np.isfinite(a).all(), "unwritten (poisoned) or non-finite output"
        return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))

    assert rel(s, s64) <= 1e-7
    assert rel(y, y64) <= (1e-5 if out_dtype is None else 1e-2)
    assert rel(mean.reshape(-1), m.reshape(-1)) <= 1e-5 and rel(rstd.reshape(-1), rs.reshape(-1)) <= 1e-5


def test_residual_layernorm_nan_rows_are_the_unfused_bits() -> None:
    """A NaN in x or r: s holds the add's NaN, the row's y the quiet NaN of its sign in bf16 (the cast's), the
    other rows are untouched; all as the separate add and f32-to-bf16 LayerNorm give them."""
    import cupy as cp

    from blutrain.kernels import cuda

    *_, hx, hr, hw, hb = _inputs(3, (6, 768), 1, BF16, True)
    hx[1, 5] = np.nan
    hr[3, 700] = np.nan
    x, r, w, b = (cp.asarray(a) for a in (hx, hr, hw, hb))
    got = cuda.layer_norm(x, w, b, 1e-5, 1, BF16, residual=r)
    wide = cuda.cast(x, F32)
    assert got is not None and wide is not None
    s_ref = r + wide
    ref = cuda.layer_norm(s_ref, w, b, 1e-5, 1, BF16)
    assert ref is not None
    for g, want in ((got[3], s_ref), (got[0], ref[0]), (got[1], ref[1]), (got[2], ref[2])):
        np.testing.assert_array_equal(_bits(g), _bits(want))
    s, y = np.asarray(cp.asnumpy(got[3])), np.asarray(cp.asnumpy(got[0])).astype(np.float32)
    assert np.isnan(s[1, 5]) and np.isnan(s[3, 700]) and np.isnan(y[[1, 3]]).all()
    assert np.isfinite(y[[0, 2, 4, 5]]).all()


def test_residual_layernorm_of_views_takes_the_fresh_sums_vector_width() -> None:
    """A contiguous x view 2 bytes off alignment and a transposed (non-contiguous) r are copied first, so the
    kernel still runs with the unfused LayerNorm's vector width and gives its bits."""
    import cupy as cp

    from blutrain.kernels import cuda

    x, r, w, b, hx, *_ = _inputs(4, (9, 768), 1, BF16, True)
    raw = cp.asarray(np.concatenate([np.zeros(1, np.uint16), hx.reshape(-1).view(np.uint16)]))
    xv = raw[1:].view(BF16).reshape(9, 768)
    assert xv.data.ptr % 16 != 0
    rv = cp.ascontiguousarray(r.T).T
    got = cuda.layer_norm(xv, w, b, 1e-5, 1, None, residual=rv)
    wide = cuda.cast(x, F32)
    assert got is not None and wide is not None
    s_ref = r + wide
    ref = cuda.layer_norm(s_ref, w, b, 1e-5, 1)
    assert ref is not None
    for g, want in ((got[3], s_ref), (got[0], ref[0]), (got[1], ref[1]), (got[2], ref[2])):
        np.testing.assert_array_equal(_bits(g), _bits(want))
