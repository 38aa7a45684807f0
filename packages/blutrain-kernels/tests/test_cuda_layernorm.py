"""layernorm.cu's LayerNorm forward and backward (bf16 output, addend, bf16 dx copy, dx column sums)
against the float64 CPU references, on random data.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, DTYPES, check, dev, f64, host, rng

from blutrain.tensor.cpu import nn as cpu_nn

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


# (2001, 768) and (300, 3072): more rows than one block's row groups, so the backward's blocks loop and
# combine their dweight/dbias sums (2001: the last block's row groups partly past the rows); (3, 5000): wider
# than the register-resident backward holds.
LN_SHAPES = [((5, 768), 1), ((7, 100), 1), ((3, 33), 1), ((2, 3, 256), 1), ((4, 6, 10), 2), ((2, 4096), 1),
             ((2001, 768), 1), ((300, 3072), 1), ((3, 5000), 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "k"), LN_SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_forward_matches_float64(dtype: Any, shape: tuple[int, ...], k: int, affine: bool) -> None:
    from blutrain.kernels import cuda

    r = rng(1)
    ns = shape[len(shape) - k:]
    x = f64(r.standard_normal(shape) * 3 + 1.5, dtype)
    w = f64(r.standard_normal(ns), dtype) if affine else None
    b = f64(r.standard_normal(ns), dtype) if affine else None
    res = cuda.layer_norm(dev(x, dtype), None if w is None else dev(w, dtype), None if b is None else dev(b, dtype),
                          1e-5, k)
    assert res is not None
    ry, rm, rr = cpu_nn.layer_norm(x, w, b, 1e-5, k)
    check(res[0], ry, dtype)
    assert res[1].dtype == np.float32 and res[2].dtype == np.float32
    check(res[1], rm, np.float32)
    check(res[2], rr, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "k"), LN_SHAPES)
@pytest.mark.parametrize(("affine", "need_w", "need_b"),
                         [(True, True, True), (True, False, True), (False, False, False)])
def test_layer_norm_backward_matches_float64(dtype: Any, shape: tuple[int, ...], k: int, affine: bool, need_w: bool,
                                             need_b: bool) -> None:
    from blutrain.kernels import cuda

    r = rng(2)
    ns = shape[len(shape) - k:]
    x = f64(r.standard_normal(shape) * 2 - 0.5, dtype)
    g = f64(r.standard_normal(shape), dtype)
    w = f64(r.standard_normal(ns), dtype) if affine else None
    _, mean, rstd = cpu_nn.layer_norm(x, w, None, 1e-5, k)
    mean, rstd = f64(mean, np.float32), f64(rstd, np.float32)  # what the forward saved
    res = cuda.layer_norm_backward(dev(g, dtype), dev(x, dtype), None if w is None else dev(w, dtype),
                                   dev(mean, np.float32), dev(rstd, np.float32), k, need_w, need_b)
    assert res is not None
    rgx, rgw, rgb = cpu_nn.layer_norm_backward(g, x, w, mean, rstd, k, need_w, need_b)
    check(res[0], rgx, dtype)
    assert (res[1] is None) == (not need_w) and (res[2] is None) == (not need_b)
    if need_w:
        check(res[1], rgw, dtype)
    if need_b:
        check(res[2], rgb, dtype)


@pytest.mark.parametrize(("shape", "k"), LN_SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_writes_bf16_as_its_float32_output_cast(shape: tuple[int, ...], k: int, affine: bool) -> None:
    """float32 in, bf16 out: each result rounded once, the bits of the float32 kernel's output through the
    cast kernel (a NaN in the first row: its outputs are the cast's quiet NaN); the statistics unchanged."""
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(8)
    ns = shape[len(shape) - k:]
    xh = r.standard_normal(shape) * 3 + 1
    xh.reshape(-1)[0] = np.nan
    x = dev(xh, np.float32)
    w, b = (dev(r.standard_normal(ns), np.float32) if affine else None for _ in range(2))
    plain = cuda.layer_norm(x, w, b, 1e-5, k)
    folded = cuda.layer_norm(x, w, b, 1e-5, k, BF16)
    assert plain is not None and folded is not None and folded[0].dtype == BF16
    cast = cuda.cast(plain[0], BF16)
    assert cast is not None
    assert cp.array_equal(folded[0].view(np.uint16), cast.view(np.uint16))
    assert cp.array_equal(folded[1], plain[1], equal_nan=True) and cp.array_equal(folded[2], plain[2], equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "k"), LN_SHAPES)
def test_layer_norm_backward_adds_the_addend_to_dx(dtype: Any, shape: tuple[int, ...], k: int) -> None:
    """dx + addend as dx is stored: in float32 the bits of the kernel's dx followed by a float32 add; in bf16
    within its tolerance of the float64 sum (one rounding less than a separate add)."""
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(9)
    ns = shape[len(shape) - k:]
    x, g = f64(r.standard_normal(shape), dtype), f64(r.standard_normal(shape), dtype)
    w, addend = f64(r.standard_normal(ns), dtype), f64(r.standard_normal(shape) * 3, dtype)
    _, mean, rstd = cpu_nn.layer_norm(x, w, None, 1e-5, k)
    args = (dev(g, dtype), dev(x, dtype), dev(w, dtype), dev(f64(mean, np.float32), np.float32),
            dev(f64(rstd, np.float32), np.float32), k, True, True)
    plain = cuda.layer_norm_backward(*args)
    fused = cuda.layer_norm_backward(*args, dev(addend, dtype))
    assert plain is not None and fused is not None
    if np.dtype(dtype) == np.float32:
        assert cp.array_equal(fused[0], plain[0] + dev(addend, dtype))
    else:
        check(fused[0], host(plain[0]) + addend, dtype)
    for a, b in zip(fused[1:], plain[1:], strict=True):  # the parameter gradients do not see the addend
        assert cp.array_equal(a, b)


def _ln_backward_args(seed: int, shape: tuple[int, ...], k: int, nan: bool = False) -> tuple[Any, ...]:
    """float32 device arguments of layer_norm_backward (g, x, w, mean, rstd, k) and a float32 addend; with
    ``nan`` the first element of g is NaN (the first row's dx is then NaN)."""
    r = rng(seed)
    ns = shape[len(shape) - k:]
    x, g = r.standard_normal(shape) * 2 - 0.5, r.standard_normal(shape)
    if nan:
        g.reshape(-1)[0] = np.nan
    w, addend = r.standard_normal(ns), r.standard_normal(shape) * 3
    _, mean, rstd = cpu_nn.layer_norm(f64(x, np.float32), f64(w, np.float32), None, 1e-5, k)
    return (dev(g, np.float32), dev(x, np.float32), dev(w, np.float32), dev(mean, np.float32),
            dev(rstd, np.float32), k), dev(addend, np.float32)


@pytest.mark.parametrize(("shape", "k"), LN_SHAPES)
@pytest.mark.parametrize("addend", [False, True])
@pytest.mark.parametrize("need_sum", [False, True])
def test_layer_norm_backward_writes_dx_in_bf16_as_the_cast_kernel(shape: tuple[int, ...], k: int, addend: bool,
                                                                   need_sum: bool) -> None:
    """float32 dx also stored as bf16 (the layernorm-grad-outputs pass): the cast kernel's bits of the stored dx,
    the first row's NaNs the cast's quiet NaN; dx the plain call's bits."""
    import cupy as cp

    from blutrain.kernels import cuda

    args, a = _ln_backward_args(10, shape, k, nan=True)
    extra = a if addend else None
    plain = cuda.layer_norm_backward(*args, True, True, extra)
    out = cuda.layer_norm_backward(*args, True, True, extra, BF16, need_sum)
    assert plain is not None and out is not None and len(out) == 5
    assert cp.array_equal(out[0].view(np.uint32), plain[0].view(np.uint32))
    assert out[3].dtype == BF16 and out[3].shape == shape and (out[4] is None) == (not need_sum)
    cast = cuda.cast(plain[0], BF16)
    assert cast is not None
    assert cp.array_equal(out[3].view(np.uint16), cast.view(np.uint16))


@pytest.mark.parametrize(("shape", "k"), LN_SHAPES)
@pytest.mark.parametrize("addend", [False, True])
@pytest.mark.parametrize(("copy", "need_w", "need_b"),
                         [(True, True, True), (False, True, False), (False, False, False)])
def test_layer_norm_backward_sums_the_columns_of_dx(shape: tuple[int, ...], k: int, addend: bool, copy: bool,
                                                    need_w: bool, need_b: bool) -> None:
    """dx's column sums over its leading dims (a float32 bias's gradient under autocast): in this kernel's fixed
    order, not sum_cols', so held to the float64 sums of the stored dx within rows * 2^-24 of the summed
    magnitudes (any order's bound), and the same bits on a second call. dx is the plain call's bits; dweight
    and dbias its values to float32 rounding (the _out kernel may hold fewer blocks per SM, and G blocks'
    partials are then grouped otherwise; at GPT-2's widths it holds as many)."""
    import cupy as cp

    from blutrain.kernels import cuda

    args, a = _ln_backward_args(11, shape, k)
    extra = a if addend else None
    plain = cuda.layer_norm_backward(*args, need_w, need_b, extra)
    out = cuda.layer_norm_backward(*args, need_w, need_b, extra, BF16 if copy else None, True)
    again = cuda.layer_norm_backward(*args, need_w, need_b, extra, BF16 if copy else None, True)
    assert plain is not None and out is not None and again is not None
    assert cp.array_equal(out[0], plain[0])
    for got, want in zip(out[1:3], plain[1:], strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            check(got, host(want), np.float32)
    assert (out[3] is None) == (not copy)
    lead = len(shape) - k
    dx = host(plain[0])
    total = out[4]
    assert total.dtype == np.float32 and total.shape == shape[lead:]
    ref = dx.sum(axis=tuple(range(lead)))
    bound = math.prod(shape[:lead]) * 2.0**-24 * np.abs(dx).sum(axis=tuple(range(lead)))
    assert np.all(np.abs(host(total) - ref) <= bound)
    assert cp.array_equal(again[4], total)  # deterministic


def test_layer_norm_backward_leaves_other_dtypes_extra_outputs_to_the_generic_kernel() -> None:
    """Only float32 dx has the bf16 copy and the column sums here: None (the generic kernel) otherwise."""
    from blutrain.kernels import cuda

    args, _ = _ln_backward_args(12, (5, 768), 1)
    g, x, w, mean, rstd, k = args
    half = (dev(host(g), BF16), dev(host(x), BF16), dev(host(w), BF16), mean, rstd, k, True, True, None)
    assert cuda.layer_norm_backward(*half, None, True) is None
    assert cuda.layer_norm_backward(*half, BF16) is None
    assert cuda.layer_norm_backward(*args, True, True, None, np.float16) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("C", [768, 100])
def test_layer_norm_backward_is_bitwise_reproducible(dtype: Any, C: int) -> None:
    """dx, dweight and dbias: the same bits from two calls (the dweight/dbias partials add in a fixed order,
    in registers for float32 and in shared-memory slots for bf16)."""
    from blutrain.kernels import cuda

    r = rng(3)
    x = dev(r.standard_normal((4001, C)), dtype)
    g = dev(r.standard_normal((4001, C)), dtype)
    w = dev(r.standard_normal(C), dtype)
    mean = dev(r.standard_normal(4001), np.float32)
    rstd = dev(r.uniform(0.5, 2.0, 4001), np.float32)
    first = cuda.layer_norm_backward(g, x, w, mean, rstd, 1, True, True)
    second = cuda.layer_norm_backward(g, x, w, mean, rstd, 1, True, True)
    assert first is not None and second is not None
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(host(a), host(b))
