"""The hand-written CUDA kernels against the float64 CPU references, on random data.

Every output is written into poisoned memory (all bytes 0xFF: NaN for floats) so that an element the
kernel forgets to write fails the finiteness check. float32 results must be within 1e-5 relative
error (||out - ref|| / ||ref||) of the float64 reference, bfloat16 results within 1e-2. Per-row
statistics (mean, rstd, log-sum-exp) are float32 for both input dtypes and held to 1e-5. Skipped
without an NVIDIA GPU and CuPy.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blutrain.tensor.cpu import indexing as cpu_ix
from blutrain.tensor.cpu import nn as cpu_nn
from blutrain.tensor.cpu import reduction as cpu_rd
from blutrain.tensor.cpu.elementwise import gelu as cpu_gelu
from blutrain.tensor.cpu.elementwise import gelu_backward as cpu_gelu_backward

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16]
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def dev(a: np.ndarray[Any, Any], dtype: Any = None) -> Any:
    import cupy as cp

    return cp.asarray(a if dtype is None else a.astype(dtype))


def host(a: Any) -> np.ndarray[Any, Any]:
    import cupy as cp

    return np.asarray(cp.asnumpy(a)).astype(np.float64)


def f64(a: np.ndarray[Any, Any], dtype: Any) -> np.ndarray[Any, Any]:
    """The values a device array of ``dtype`` holds, in float64 (bf16 rounding included)."""
    return a.astype(dtype).astype(np.float64)


def check(out: Any, ref: np.ndarray[Any, Any], dtype: Any, tol: float | None = None, floor: float = 1e-30) -> None:
    """||out - ref|| / max(||ref||, floor) within the dtype's tolerance; ``floor`` keeps a reference
    that is zero up to rounding (a gradient that cancels exactly) from dividing by nothing."""
    got = host(out)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all() or not np.isfinite(ref).all(), "unwritten (poisoned) or non-finite output"
    assert np.array_equal(np.isfinite(got), np.isfinite(ref))
    fin = np.isfinite(ref)
    err = np.linalg.norm(got[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), floor)
    assert err <= (tol if tol is not None else TOL[np.dtype(dtype).name]), f"relative error {err:.3g}"


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------- LayerNorm

# (2000, 768) and (300, 3072): more rows than one block's row groups, so the backward's blocks loop and
# combine their dweight/dbias sums; (3, 5000): wider than the register-resident backward holds.
LN_SHAPES = [((5, 768), 1), ((7, 100), 1), ((3, 33), 1), ((2, 3, 256), 1), ((4, 6, 10), 2), ((2, 4096), 1),
             ((2000, 768), 1), ((300, 3072), 1), ((3, 5000), 1)]


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


# ------------------------------------------------------------------------------------------- GELU


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(4096,), (4099,), (3, 5, 7), (1,)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_forward_and_backward_match_float64(dtype: Any, shape: tuple[int, ...], approximate: str) -> None:
    from blutrain.kernels import cuda

    r = rng(3)
    x = f64(r.standard_normal(shape) * 3, dtype)
    g = f64(r.standard_normal(shape), dtype)
    check(cuda.gelu(dev(x, dtype), approximate), cpu_gelu(x, approximate), dtype)
    check(cuda.gelu_backward(dev(g, dtype), dev(x, dtype), approximate), cpu_gelu_backward(g, x, approximate), dtype)


def test_gelu_of_an_unaligned_view_uses_the_scalar_path() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    x = rng(4).standard_normal(1001).astype(np.float32)
    view = cp.asarray(x)[1:]  # 4-byte offset: no 16-byte loads
    check(cuda.gelu(view, "tanh"), cpu_gelu(x[1:].astype(np.float64), "tanh"), np.float32)


# (2000, 768), (5000, 40): many row chunks whose bias partials the last block of each column tile adds;
# (7, 33), (3, 5, 1001): odd widths (no 16-byte accesses); (40, 50304): one row chunk per tile.
BIAS_GELU_SHAPES = [(4, 768), (3, 5, 1001), (2000, 768), (7, 33), (1, 8), (300, 3072), (5000, 40), (40, 50304)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", BIAS_GELU_SHAPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_forward_and_backward_match_float64(dtype: Any, shape: tuple[int, ...], approximate: str) -> None:
    from blutrain.kernels import cuda

    r = rng(14)
    x = f64(r.standard_normal(shape) * 2, dtype)
    b = f64(r.standard_normal(shape[-1]), dtype)
    g = f64(r.standard_normal(shape), dtype)
    check(cuda.bias_gelu(dev(x, dtype), dev(b, dtype), approximate), cpu_nn.bias_gelu(x, b, approximate), dtype)
    res = cuda.bias_gelu_backward(dev(g, dtype), dev(x, dtype), dev(b, dtype), approximate, True)
    assert res is not None
    rdx, rdb = cpu_nn.bias_gelu_backward(g, x, b, approximate, True)
    check(res[0], rdx, dtype)
    check(res[1], rdb, dtype)


def test_bias_gelu_backward_without_the_bias_gradient_writes_dx_only() -> None:
    from blutrain.kernels import cuda

    r = rng(15)
    x, b, g = r.standard_normal((300, 96)), r.standard_normal(96), r.standard_normal((300, 96))
    res = cuda.bias_gelu_backward(dev(g, np.float32), dev(x, np.float32), dev(b, np.float32), "tanh", False)
    assert res is not None and res[1] is None
    check(res[0], cpu_nn.bias_gelu_backward(g, x, b, "tanh", False)[0], np.float32)


def test_bias_gelu_of_unaligned_rows_uses_the_scalar_path() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(16)
    flat, b, g = r.standard_normal(1 + 50 * 64), r.standard_normal(64), r.standard_normal((50, 64))
    x = cp.asarray(flat.astype(np.float32))[1:].reshape(50, 64)  # 4-byte offset: no 16-byte accesses
    xr = flat[1:].reshape(50, 64).astype(np.float32).astype(np.float64)
    check(cuda.bias_gelu(x, dev(b, np.float32), "tanh"), cpu_nn.bias_gelu(xr, b, "tanh"), np.float32)
    res = cuda.bias_gelu_backward(dev(g, np.float32), x, dev(b, np.float32), "tanh", True)
    assert res is not None
    rdx, rdb = cpu_nn.bias_gelu_backward(g, xr, b, "tanh", True)
    check(res[0], rdx, np.float32)
    check(res[1], rdb, np.float32)


# ------------------------------------------------------------------------------------------- cross-entropy

CE_CASES = [(6, 1000), (3, 50304), (5, 37)]


def _ce_data(n: int, c: int, dtype: Any, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    r = rng(seed)
    logits = f64(r.standard_normal((n, c)) * 4, dtype)
    target = r.integers(0, c, n).astype(np.int64)
    target[1] = -100
    return logits, target


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("n", "c"), CE_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_forward_matches_float64(dtype: Any, n: int, c: int, reduction: str, smoothing: float) -> None:
    from blutrain.kernels import cuda

    logits, target = _ce_data(n, c, dtype, 5)
    res = cuda.cross_entropy(dev(logits, dtype), dev(target), -100, smoothing, reduction)
    assert res is not None
    rloss, rlse = cpu_nn.cross_entropy(logits, target, -100, smoothing, reduction)
    check(res[0], np.asarray(rloss), dtype)
    check(res[1], rlse, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("n", "c"), CE_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_backward_matches_float64(dtype: Any, n: int, c: int, reduction: str, smoothing: float) -> None:
    from blutrain.kernels import cuda

    logits, target = _ce_data(n, c, dtype, 6)
    _, lse = cpu_nn.cross_entropy(logits, target, -100, smoothing, reduction)
    lse = f64(lse, np.float32)
    grad = f64(rng(7).standard_normal(n if reduction == "none" else ()), dtype)
    out = cuda.cross_entropy_backward(dev(grad, dtype), dev(logits, dtype), dev(target), dev(lse, np.float32), -100,
                                      smoothing, reduction)
    ref = cpu_nn.cross_entropy_backward(grad, logits, target, lse, -100, smoothing, reduction)
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_grad_fuses_the_backward(dtype: Any, reduction: str) -> None:
    from blutrain.kernels import cuda

    logits, target = _ce_data(4, 50304, dtype, 8)
    res = cuda.cross_entropy_with_grad(dev(logits, dtype), dev(target), -100, 0.1, reduction)
    assert res is not None
    rloss, rlse = cpu_nn.cross_entropy(logits, target, -100, 0.1, reduction)
    check(res[0], np.asarray(rloss), dtype)
    check(res[2], cpu_nn.cross_entropy_backward(np.ones(()), logits, target, rlse, -100, 0.1, reduction), dtype)


# ------------------------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(4, 1000), (3, 7), (2, 3, 64)])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_forward_and_backward_match_float64(dtype: Any, shape: tuple[int, ...], log: bool) -> None:
    from blutrain.kernels import cuda

    r = rng(9)
    x = f64(r.standard_normal(shape) * 5, dtype)
    x[..., 0, 1] = -np.inf  # a masked entry
    g = f64(r.standard_normal(shape), dtype)
    fwd = cuda.log_softmax if log else cuda.softmax
    bwd = cuda.log_softmax_backward if log else cuda.softmax_backward
    ref = (cpu_rd.log_softmax if log else cpu_rd.softmax)(x, -1)
    check(fwd(dev(x, dtype), -1), ref, dtype)
    y = f64(ref, dtype)
    check(bwd(dev(g, dtype), dev(y, dtype), -1),
          (cpu_rd.log_softmax_backward if log else cpu_rd.softmax_backward)(g, y, -1), dtype)


def test_softmax_over_another_axis_is_left_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    assert cuda.softmax(dev(np.ones((3, 4), np.float32)), 0) is None


# ------------------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dim", [768, 10])
def test_embedding_forward_gathers_rows(dtype: Any, dim: int) -> None:
    from blutrain.kernels import cuda

    r = rng(10)
    w = f64(r.standard_normal((50, dim)), dtype)
    idx = r.integers(0, 50, (3, 7)).astype(np.int64)
    check(cuda.embedding(dev(w, dtype), dev(idx)), cpu_ix.embedding(w, idx), dtype, tol=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dim", [768, 10])
@pytest.mark.parametrize("deterministic", [True, False])
def test_embedding_backward_sums_rows_per_id(dtype: Any, dim: int, deterministic: bool) -> None:
    from blutrain.kernels import cuda

    r = rng(11)
    idx = r.integers(0, 40, (4, 9)).astype(np.int64)
    idx[0, :5] = 3  # repeats
    g = f64(r.standard_normal((4, 9, dim)), dtype)
    cuda.set_deterministic(deterministic)
    try:
        out = cuda.embedding_backward(dev(g, dtype), dev(idx), 57)
    finally:
        cuda.set_deterministic(True)
    check(out, cpu_ix.embedding_backward(g, idx, 57), dtype)


def test_deterministic_embedding_backward_is_bitwise_reproducible() -> None:
    from blutrain.kernels import cuda

    r = rng(12)
    idx = dev(r.integers(0, 5, 4000).astype(np.int64))
    g = dev(r.standard_normal((4000, 64)).astype(np.float32))
    a, b = host(cuda.embedding_backward(g, idx, 5)), host(cuda.embedding_backward(g, idx, 5))
    assert np.array_equal(a, b)


# ------------------------------------------------------------------------------------------- reduce-sum


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "axes"), [((1000, 768), (0,)), ((3, 4, 5), (0, 1)), ((3, 4, 5), (1, 2)),
                                             ((3, 4, 5), (2,)), ((70, 33), (0,)), ((2, 4096), (1,))])
@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_over_leading_or_trailing_axes_matches_float64(dtype: Any, shape: tuple[int, ...], axes: tuple[int, ...],
                                                           keepdim: bool) -> None:
    from blutrain.kernels import cuda

    x = f64(rng(13).standard_normal(shape), dtype)
    check(cuda.sum(dev(x, dtype), axes, keepdim), x.sum(axis=axes, keepdims=keepdim), dtype)


def test_sum_over_middle_axes_is_left_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    assert cuda.sum(dev(np.ones((3, 4, 5), np.float32)), (1,), False) is None


# One launch: (3000, 768), (5000, 40), (20000, 96) split rows into many chunks whose partials the last
# block of each column tile adds; (300, 50304) has one chunk per tile; (129, 4097), (9, 5) odd widths.
SUM_COLS_SHAPES = [(1, 5), (9, 5), (3, 768), (3000, 768), (5000, 40), (20000, 96), (129, 4097), (300, 50304)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SUM_COLS_SHAPES)
def test_sum_cols_matches_float64(dtype: Any, shape: tuple[int, int]) -> None:
    from blutrain.kernels import cuda

    x = f64(rng(17).standard_normal(shape), dtype)
    check(cuda.sum_cols(dev(x, dtype)), x.sum(axis=0), dtype)


def test_sum_cols_of_unaligned_rows_uses_the_scalar_path() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    flat = rng(18).standard_normal(1 + 2000 * 64).astype(np.float32)
    x = cp.asarray(flat)[1:].reshape(2000, 64)  # 4-byte offset: no 16-byte loads
    check(cuda.sum_cols(x), flat[1:].reshape(2000, 64).astype(np.float64).sum(axis=0), np.float32)


def test_column_sums_are_reproducible_across_launches_streams_and_kernels() -> None:
    """Every launch leaves the tile counters at zero for the next (else a tile's sum goes unwritten)."""
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(19)
    a, b = r.standard_normal((3000, 768)).astype(np.float32), r.standard_normal((5000, 40)).astype(np.float32)
    first = [host(cuda.sum_cols(dev(a))), host(cuda.sum_cols(dev(b)))]
    for _ in range(3):
        g = dev(r.standard_normal((2000, 768)).astype(np.float32))
        res = cuda.bias_gelu_backward(g, g, dev(np.zeros(768, np.float32)), "tanh", True)  # shares the scratch
        assert res is not None
        with cp.cuda.Stream():
            assert np.array_equal(host(cuda.sum_cols(dev(b))), first[1])
        assert np.array_equal(host(cuda.sum_cols(dev(a))), first[0])
        assert np.array_equal(host(cuda.sum_cols(dev(b))), first[1])
    check(cp.asarray(first[0]), a.astype(np.float64).sum(axis=0), np.float32)


# ------------------------------------------------------------------------------------------- AdamW


def _adamw_reference(p: list[np.ndarray[Any, Any]], g: list[np.ndarray[Any, Any]], m: list[np.ndarray[Any, Any]],
                     v: list[np.ndarray[Any, Any]], lr: float, b1: float, b2: float, eps: float, wds: list[float],
                     step: int, max_norm: float | None) -> tuple[list[Any], list[Any], list[Any], float]:
    norm = float(np.sqrt(sum(float((x * x).sum()) for x in g)))
    clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm is not None else 1.0
    outs: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    for pi, gi, mi, vi, wd in zip(p, g, m, v, wds, strict=True):
        gi = gi * clip
        pi = pi * (1 - lr * wd)
        mi = b1 * mi + (1 - b1) * gi
        vi = b2 * vi + (1 - b2) * gi * gi
        pi = pi - lr / (1 - b1**step) * mi / (np.sqrt(vi) / np.sqrt(1 - b2**step) + eps)
        outs[0].append(pi)
        outs[1].append(mi)
        outs[2].append(vi)
    return outs[0], outs[1], outs[2], norm


def _step_scalars(lr: float, b1: float, b2: float, step: int) -> Any:
    """The kernel's float64 [3] device array (lr, 1 - b1**t, sqrt(1 - b2**t)), as the AdamW plugin fills it."""
    return dev(np.array([lr, 1.0 - b1**step, np.sqrt(1.0 - b2**step)], np.float64))


@pytest.mark.parametrize("max_norm", [None, 1.0, 1e6])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: d.name)
def test_adamw_multi_tensor_matches_float64(max_norm: float | None, grad_dtype: Any) -> None:
    from blutrain.kernels import cuda

    r = rng(14)
    shapes = [(5,), (65536 + 7,), (40, 100), (3,)]
    p = [r.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes]
    g = [f64(r.standard_normal(s) * 0.1, grad_dtype) for s in shapes]
    m = [r.standard_normal(s).astype(np.float32).astype(np.float64) * 0.01 for s in shapes]
    v = [np.abs(r.standard_normal(s)).astype(np.float32).astype(np.float64) * 1e-3 for s in shapes]
    wds = [0.1, 0.1, 0.0, 0.01]
    dp, dm, dv = ([dev(a, np.float32) for a in xs] for xs in (p, m, v))
    norm = cuda.adamw_multi_tensor(dp, [dev(a, grad_dtype) for a in g], dm, dv, _step_scalars(1e-3, 0.9, 0.95, 7),
                                   0.9, 0.95, 1e-8, wds, max_grad_norm=max_norm)
    rp, rm, rv, rnorm = _adamw_reference(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, wds, 7, max_norm)
    for got, ref in zip(dp + dm + dv, rp + rm + rv, strict=True):
        check(got, ref, np.float32)
    if max_norm is None:
        assert norm is None
    else:
        check(norm, np.asarray(rnorm), np.float32)


def test_adamw_multi_tensor_second_step_on_the_same_buffers_matches_float64() -> None:
    """The second call reuses the cached launch plan; an unaligned view takes the element-wise path."""
    from blutrain.kernels import cuda

    r = rng(15)
    shapes = [(3000,), (2049,), (7,)]
    p = [r.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes]
    gs = [[r.standard_normal(s).astype(np.float32).astype(np.float64) * 0.1 for s in shapes] for _ in range(2)]
    m = [np.zeros(s) for s in shapes]
    v = [np.zeros(s) for s in shapes]
    dp = [dev(a, np.float32) for a in p]
    dp[0] = dev(np.concatenate([[0.0], p[0]]), np.float32)[1:]  # 4-byte offset: not 16-byte aligned
    dm, dv = [dev(a, np.float32) for a in m], [dev(a, np.float32) for a in v]
    dg = [dev(a, np.float32) for a in gs[0]]
    for step in (1, 2):
        for buf, src in zip(dg, gs[step - 1], strict=True):
            buf[...] = dev(src, np.float32)
        cuda.adamw_multi_tensor(dp, dg, dm, dv, _step_scalars(1e-3, 0.9, 0.95, step), 0.9, 0.95, 1e-8, 0.1)
        p, m, v, _ = _adamw_reference(p, gs[step - 1], m, v, 1e-3, 0.9, 0.95, 1e-8, [0.1] * 3, step, None)
    for got, ref in zip(dp + dm + dv, p + m + v, strict=True):
        check(got, ref, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_scale_multi_tensor_equals_one_multiply_per_tensor_bit_for_bit(dtype: Any) -> None:
    """Sizes around the 4096-element tile, an empty array and a strided view (scaled where it lies), all in one
    call; every element equals the float product of the widened operands rounded once (NumPy/ml_dtypes)."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(0)
    sizes = [1, 3, 4095, 4096, 4097, 10_000, 0, 50_304]
    hosts = [rng.standard_normal(n).astype(dtype) for n in sizes]
    arrays = [cp.asarray(h) for h in hosts]
    base = cp.asarray(rng.standard_normal((64, 48)).astype(dtype))
    strided = base[:, ::3]
    before_base = cp.asnumpy(base)
    coef = np.array(0.37109375, dtype)
    cuda.scale_multi_tensor([*arrays, strided], cp.asarray(coef))
    for h, a in zip(hosts, arrays, strict=True):
        want = (h.astype(np.float32) * coef.astype(np.float32)).astype(dtype)
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), want.view(np.uint8))
    want_base = before_base.copy()
    want_base[:, ::3] = (before_base[:, ::3].astype(np.float32) * coef.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(cp.asnumpy(base).view(np.uint8), want_base.view(np.uint8))


def test_scale_multi_tensor_in_a_captured_graph_reads_each_replays_coefficient() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    xs = [cp.ones(n, np.float32) for n in (5, 9000)]
    coef = cp.asarray(np.float32(0.5))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cuda.scale_multi_tensor(xs, coef)  # the plan is built (and cached) outside the capture first
        stream.begin_capture()
        cuda.scale_multi_tensor(xs, coef)
        graph = stream.end_capture()
        coef[...] = 0.25
        graph.launch(stream)
        coef[...] = 2.0
        graph.launch(stream)
    stream.synchronize()
    for x in xs:
        np.testing.assert_array_equal(cp.asnumpy(x), np.full(x.size, 0.5 * 0.25 * 2.0, np.float32))


def test_scale_multi_tensor_rejects_mixed_dtypes_and_a_coefficient_of_another_dtype() -> None:
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.tensor.errors import TensorTypeError

    a, b = cp.ones(4, np.float32), cp.ones(4, BF16)
    with pytest.raises(TensorTypeError, match="array 1 must be a CuPy array of dtype float32"):
        cuda.scale_multi_tensor([a, b], cp.asarray(np.float32(2)))
    with pytest.raises(TensorTypeError, match="coef must be a 0-d CuPy array of dtype float32"):
        cuda.scale_multi_tensor([a], cp.asarray(np.float64(2)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_norm_multi_tensor_matches_float64_over_tiles_empty_and_strided_arrays(dtype: Any) -> None:
    """The clip's norm over sizes around the 4096-element tile, an empty array and a strided view, against
    the float64 norm of the same values; the same value again (fixed summation order); and in a captured
    graph, reading each replay's values."""
    import cupy as cp

    from blutrain.kernels import cuda

    rng = np.random.default_rng(1)
    sizes = [1, 3, 4095, 4096, 4097, 10_000, 0, 50_304]
    hosts = [rng.standard_normal(n).astype(dtype) for n in sizes]
    base = rng.standard_normal((64, 48)).astype(dtype)
    arrays = [*(cp.asarray(h) for h in hosts), cp.asarray(base)[:, ::3]]
    values = np.concatenate([*(h.astype(np.float64) for h in hosts), base[:, ::3].astype(np.float64).ravel()])
    want = float(np.linalg.norm(values))
    got = cuda.norm_multi_tensor(arrays)
    assert got.dtype == np.float32 and got.shape == ()
    assert abs(float(got) - want) <= 1e-6 * want
    assert float(cuda.norm_multi_tensor(arrays)) == float(got)
    assert float(cuda.norm_multi_tensor([cp.zeros(0, dtype)])) == 0.0
    dense = arrays[:6]
    stream = cp.cuda.Stream(non_blocking=True)
    # the kernel allocates its partial sums and result: from a pool that holds the blocks before the capture
    # (a cudaMalloc inside a capture breaks it, and memcheck runs with CuPy's pool off)
    pool = cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(pool.malloc):
        cuda.norm_multi_tensor(dense)  # the plan is built (and cached), the pool filled, outside the capture
        stream.synchronize()
        stream.begin_capture()
        out = cuda.norm_multi_tensor(dense)
        graph = stream.end_capture()
        for a in dense:
            a *= 2
        graph.launch(stream)
    stream.synchronize()
    twice = 2 * float(np.linalg.norm(np.concatenate([h.astype(np.float64) for h in hosts[:6]])))
    assert abs(float(out) - twice) <= 1e-6 * twice


def test_adamw_multi_tensor_rejects_a_non_float32_param() -> None:
    from blutrain.kernels import cuda
    from blutrain.tensor.errors import TensorTypeError

    x = dev(np.ones(4, np.float64))
    with pytest.raises(TensorTypeError, match="param 0 must be a contiguous float32"):
        cuda.adamw_multi_tensor([x], [x], [x], [x], _step_scalars(1e-3, 0.9, 0.999, 1), 0.9, 0.999, 1e-8, 0.0)


def test_adamw_multi_tensor_rejects_step_scalars_that_are_not_a_float64_device_array() -> None:
    from blutrain.kernels import cuda
    from blutrain.tensor.errors import TensorTypeError

    x = dev(np.ones(4, np.float32))
    for bad in (np.array([1e-3, 0.1, 0.03]), dev(np.array([1e-3, 0.1, 0.03], np.float32))):
        with pytest.raises(TensorTypeError, match="step_scalars must be a contiguous float64 CuPy array"):
            cuda.adamw_multi_tensor([x], [x], [x], [x], bad, 0.9, 0.999, 1e-8, 0.0)


def test_a_captured_adamw_graph_replays_with_the_step_scalars_written_since() -> None:
    """One capture (its launch tables uploaded outside the capture), three replays with new lr and step."""
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(16)
    shapes = [(3000,), (2048,), (5,)]
    p = [r.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes]
    m = [np.zeros(s) for s in shapes]
    v = [np.zeros(s) for s in shapes]
    dp, dm, dv = ([dev(a, np.float32) for a in xs] for xs in (p, m, v))
    dg = [dev(np.zeros(s), np.float32) for s in shapes]
    scalars = _step_scalars(1.0, 0.9, 0.95, 1)  # values the replays must not see
    for name in ("adamw_sqnorm", "adamw_update"):
        cuda.function("adamw", name)  # compiled and loaded before the capture
    pool = cp.cuda.MemoryPool()  # the graph's scratch (the clip's partial sums) stays out of others' reach
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            norm = cuda.adamw_multi_tensor(dp, dg, dm, dv, scalars, 0.9, 0.95, 1e-8, 0.1, max_grad_norm=1.0)
        finally:
            graph = stream.end_capture()
    for step, lr in ((1, 1e-3), (2, 3e-3), (3, 2e-3)):
        gs = [r.standard_normal(s).astype(np.float32).astype(np.float64) * 0.1 for s in shapes]
        for buf, src in zip(dg, gs, strict=True):
            buf[...] = dev(src, np.float32)
        scalars[...] = _step_scalars(lr, 0.9, 0.95, step)
        cp.cuda.get_current_stream().synchronize()
        graph.launch(stream)
        stream.synchronize()
        p, m, v, rnorm = _adamw_reference(p, gs, m, v, lr, 0.9, 0.95, 1e-8, [0.1] * 3, step, 1.0)
        for got, ref in zip(dp + dm + dv, p + m + v, strict=True):
            check(got, ref, np.float32)
        check(norm, np.asarray(rnorm), np.float32)


def _adamw_case(seed: int, grad_dtype: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """Host arrays (p, g, m, v) for the grad_scale tests: one tensor over several 2048-element tiles, an n % 4
    tail, one element; the device copies get an unaligned param and grad too (see _adamw_device)."""
    r = rng(seed)
    shapes = [(5000,), (2049,), (1,), (40, 100)]
    p = [r.standard_normal(s).astype(np.float32) for s in shapes]
    g = [(r.standard_normal(s) * 0.5).astype(grad_dtype) for s in shapes]
    m = [(r.standard_normal(s) * 0.01).astype(np.float32) for s in shapes]
    v = [(np.abs(r.standard_normal(s)) * 1e-3).astype(np.float32) for s in shapes]
    return p, g, m, v


def _adamw_device(host_arrays: list[Any]) -> list[Any]:
    """Device copies; the first one 4 bytes past a 16-byte boundary (the kernels' element-wise path)."""
    import cupy as cp

    first = host_arrays[0]
    shifted = cp.asarray(np.concatenate([np.zeros(1, first.dtype), first.ravel()]))[1:].reshape(first.shape)
    return [shifted, *(cp.asarray(a) for a in host_arrays[1:])]


def _bits_equal(got: Any, want: Any) -> None:
    import cupy as cp

    g, w = cp.asnumpy(got), cp.asnumpy(want)
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g.view(f"u{g.dtype.itemsize}"), w.view(f"u{w.dtype.itemsize}"))


@pytest.mark.parametrize("coef", [0.3, 1.0, 2.5e-3, 0.7071067811865476])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: d.name)
def test_adamw_grad_scale_equals_scaling_the_grads_in_place_first_bit_for_bit(grad_dtype: Any, coef: float) -> None:
    """What the compiler's adamw-grad-scale pass relies on: adamw_multi_tensor(..., grad_scale=c) gives the bits of
    scale_multi_tensor(grads, c) followed by adamw_multi_tensor without it (each product rounded once, to the
    gradient's dtype; never contracted into the update's FMAs), and leaves the gradients unchanged."""
    import cupy as cp

    from blutrain.kernels import cuda

    p, g, m, v = _adamw_case(20, grad_dtype)
    wds = [0.1, 0.0, 0.1, 0.01]
    c = cp.asarray(np.asarray(coef, grad_dtype))
    # in place first, as eager clip_grad_norm_ does, then the update
    pa, ga, ma, va = (_adamw_device(xs) for xs in (p, g, m, v))
    cuda.scale_multi_tensor(ga, c)
    cuda.adamw_multi_tensor(pa, ga, ma, va, _step_scalars(1e-3, 0.9, 0.95, 3), 0.9, 0.95, 1e-8, wds)
    # the scale inside the update
    pb, gb, mb, vb = (_adamw_device(xs) for xs in (p, g, m, v))
    cuda.adamw_multi_tensor(pb, gb, mb, vb, _step_scalars(1e-3, 0.9, 0.95, 3), 0.9, 0.95, 1e-8, wds, c)
    for got, want in zip(pb + mb + vb, pa + ma + va, strict=True):
        _bits_equal(got, want)
    for got, want in zip(gb, g, strict=True):
        _bits_equal(got, cp.asarray(want))  # read, not written


def test_a_captured_adamw_graph_reads_each_replays_grad_scale() -> None:
    """One capture with grad_scale; each replay's coefficient (written into its device scalar since) gives the
    bits of an eager in-place scale and update on copies of the same buffers."""
    import cupy as cp

    from blutrain.kernels import cuda

    p, g, m, v = _adamw_case(21, np.float32)
    pg, gg, mg, vg = ([cp.asarray(a) for a in xs] for xs in (p, g, m, v))  # capture needs contiguous grads
    pe, me, ve = ([cp.asarray(a) for a in xs] for xs in (p, m, v))
    scalars = _step_scalars(1e-3, 0.9, 0.95, 1)
    coef = cp.asarray(np.float32(1.0))
    cuda.function("adamw", "adamw_update")  # compiled and loaded before the capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            cuda.adamw_multi_tensor(pg, gg, mg, vg, scalars, 0.9, 0.95, 1e-8, 0.1, coef)
        finally:
            graph = stream.end_capture()
    for step, c in ((1, 0.25), (2, 1.0), (3, 0.0625)):
        scalars[...] = _step_scalars(1e-3, 0.9, 0.95, step)
        coef[...] = cp.asarray(np.float32(c))
        cp.cuda.get_current_stream().synchronize()
        graph.launch(stream)
        stream.synchronize()
        ge = [cp.asarray(a) for a in g]
        cuda.scale_multi_tensor(ge, cp.asarray(np.float32(c)))
        cuda.adamw_multi_tensor(pe, ge, me, ve, _step_scalars(1e-3, 0.9, 0.95, step), 0.9, 0.95, 1e-8, 0.1)
        cp.cuda.get_current_stream().synchronize()
        for got, want in zip(pg + mg + vg, pe + me + ve, strict=True):
            _bits_equal(got, want)


def test_adamw_grad_scale_of_another_dtype_than_the_grads_or_with_max_grad_norm_is_refused() -> None:
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.tensor.errors import TensorTypeError

    x = dev(np.ones(4, np.float32))
    s = _step_scalars(1e-3, 0.9, 0.999, 1)
    with pytest.raises(TensorTypeError, match="grad 0 has dtype float32, grad_scale bfloat16"):
        cuda.adamw_multi_tensor([x], [x], [x], [x], s, 0.9, 0.999, 1e-8, 0.0, cp.asarray(np.asarray(0.5, BF16)))
    with pytest.raises(TensorTypeError, match="grad_scale must be a 0-d float32 or bfloat16 CuPy array"):
        cuda.adamw_multi_tensor([x], [x], [x], [x], s, 0.9, 0.999, 1e-8, 0.0, cp.ones(1, np.float32))
    with pytest.raises(TensorTypeError, match="grad_scale and max_grad_norm both given"):
        cuda.adamw_multi_tensor([x], [x], [x], [x], s, 0.9, 0.999, 1e-8, 0.0, cp.asarray(np.float32(0.5)),
                                max_grad_norm=1.0)


# ------------------------------------------------------------------------------------------- attention

ATTN_CASES = [(2, 70, 70), (1, 64, 130), (2, 130, 64), (1, 1, 5)]


def _attn_data(bh: int, L: int, S: int, D: int, dtype: Any, seed: int) -> tuple[np.ndarray[Any, Any], ...]:
    r = rng(seed)
    q = f64(r.standard_normal((bh, L, D)), dtype)
    k = f64(r.standard_normal((bh, S, D)), dtype)
    v = f64(r.standard_normal((bh, S, D)), dtype)
    g = f64(r.standard_normal((bh, L, D)), dtype)
    return q, k, v, g


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("bh", "L", "S"), ATTN_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward_matches_float64(dtype: Any, bh: int, L: int, S: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    q, k, v, _ = _attn_data(bh, L, S, D, dtype, 15)
    scale = D**-0.5
    res = cuda.sdpa(dev(q, dtype), dev(k, dtype), dev(v, dtype), None, causal, scale)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, causal, scale)
    check(res[0], rout, dtype)
    check(res[1], rlse, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("bh", "L", "S"), ATTN_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_backward_matches_float64(dtype: Any, bh: int, L: int, S: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    q, k, v, g = _attn_data(bh, L, S, D, dtype, 16)
    scale = D**-0.5
    out, lse = cpu_nn.sdpa(q, k, v, None, causal, scale)
    out, lse = f64(out, dtype), f64(lse, np.float32)  # what the forward saved
    res = cuda.sdpa_backward(dev(g, dtype), dev(q, dtype), dev(k, dtype), dev(v, dtype), dev(out, dtype),
                             dev(lse, np.float32), None, causal, scale)
    assert res is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, out, lse, None, causal, scale)
    # With one visible key dq cancels to zero exactly, hence the floor of 1 (gradients here are of
    # order 1 per element).
    for got, ref in zip(res, refs, strict=True):
        check(got, ref, dtype, floor=1.0)


def test_flash_attention_handles_batch_and_head_dims() -> None:
    from blutrain.kernels import cuda

    r = rng(17)
    q, k, v = (r.standard_normal((2, 3, 33, 64)) for _ in range(3))
    res = cuda.sdpa(dev(q, np.float32), dev(k, np.float32), dev(v, np.float32), None, True, 0.125)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, True, 0.125)
    check(res[0], rout, np.float32)
    check(res[1], rlse, np.float32)


def test_flash_attention_leaves_masks_and_other_head_dims_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    q = dev(np.ones((1, 4, 64), np.float32))
    assert cuda.sdpa(q, q, q, dev(np.ones((4, 4), bool)), False, 1.0) is None
    q32 = dev(np.ones((1, 4, 32), np.float32))
    assert cuda.sdpa(q32, q32, q32, None, False, 1.0) is None


# float32 runs on tensor cores with 3xTF32 splitting: several query and key tiles with tails (the
# cp.async pipeline refills its buffers, causal warps skip blocks), and inputs that are not 16-byte
# aligned.
ATTN_F32_CASES = [(1, 333, 333), (2, 100, 300), (1, 300, 77)]


@pytest.mark.parametrize(("bh", "L", "S"), ATTN_F32_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_float32_forward_over_many_tiles(bh: int, L: int, S: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    q, k, v, _ = _attn_data(bh, L, S, D, np.float32, 18)
    res = cuda.sdpa(dev(q, np.float32), dev(k, np.float32), dev(v, np.float32), None, causal, D**-0.5)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, causal, D**-0.5)
    check(res[0], rout, np.float32)
    check(res[1], rlse, np.float32)


@pytest.mark.parametrize(("bh", "L", "S"), ATTN_F32_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_float32_backward_over_many_tiles(bh: int, L: int, S: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    q, k, v, g = _attn_data(bh, L, S, D, np.float32, 19)
    out, lse = cpu_nn.sdpa(q, k, v, None, causal, D**-0.5)
    out, lse = f64(out, np.float32), f64(lse, np.float32)
    res = cuda.sdpa_backward(dev(g, np.float32), dev(q, np.float32), dev(k, np.float32), dev(v, np.float32),
                             dev(out, np.float32), dev(lse, np.float32), None, causal, D**-0.5)
    assert res is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, out, lse, None, causal, D**-0.5)
    for got, ref in zip(res, refs, strict=True):
        check(got, ref, np.float32, floor=1.0)


def test_flash_attention_float32_accepts_unaligned_inputs() -> None:
    from blutrain.kernels import cuda

    q, k, v, g = _attn_data(2, 90, 90, 64, np.float32, 20)

    def unaligned(a: np.ndarray[Any, Any]) -> Any:  # contiguous, but 4 bytes past a 16-byte boundary
        buf = dev(np.concatenate([np.zeros(1), a.ravel()]), np.float32)
        return buf[1:].reshape(a.shape)

    res = cuda.sdpa(unaligned(q), unaligned(k), unaligned(v), None, True, 0.125)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, True, 0.125)
    check(res[0], rout, np.float32)
    check(res[1], rlse, np.float32)
    grads = cuda.sdpa_backward(unaligned(g), unaligned(q), unaligned(k), unaligned(v), unaligned(f64(rout, np.float32)),
                               dev(rlse, np.float32), None, True, 0.125)
    assert grads is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, f64(rout, np.float32), f64(rlse, np.float32), None, True, 0.125)
    for got, ref in zip(grads, refs, strict=True):
        check(got, ref, np.float32, floor=1.0)


# bfloat16 runs on tensor cores (attention_bf16.cu): several query and key tiles with tails on both
# sides, L != S both ways (causal keys past the last query get zero gradients), 4-D inputs, inputs
# that are not 16-byte aligned, and a backward that is the same bits on every call.
ATTN_BF16_CASES = [(1, 77, 77), (2, 200, 150), (1, 150, 300), (3, 256, 256)]


@pytest.mark.parametrize(("bh", "L", "S"), ATTN_BF16_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_bfloat16_forward_over_many_tiles(bh: int, L: int, S: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    q, k, v, _ = _attn_data(bh, L, S, D, BF16, 21)
    res = cuda.sdpa(dev(q, BF16), dev(k, BF16), dev(v, BF16), None, causal, D**-0.5)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, causal, D**-0.5)
    check(res[0], rout, BF16)
    check(res[1], rlse, np.float32)


@pytest.mark.parametrize(("bh", "L", "S"), ATTN_BF16_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_bfloat16_backward_over_many_tiles(bh: int, L: int, S: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    q, k, v, g = _attn_data(bh, L, S, D, BF16, 22)
    out, lse = cpu_nn.sdpa(q, k, v, None, causal, D**-0.5)
    out, lse = f64(out, BF16), f64(lse, np.float32)
    res = cuda.sdpa_backward(dev(g, BF16), dev(q, BF16), dev(k, BF16), dev(v, BF16), dev(out, BF16),
                             dev(lse, np.float32), None, causal, D**-0.5)
    assert res is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, out, lse, None, causal, D**-0.5)
    for got, ref in zip(res, refs, strict=True):
        check(got, ref, BF16, floor=1.0)


@pytest.mark.parametrize(("bh", "L", "S"), [*ATTN_BF16_CASES, (2, 1024, 1024)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_bfloat16_d64_forward_on_hopper_is_the_wgmma_kernel(bh: int, L: int, S: int,
                                                                           causal: bool) -> None:
    """On a compute capability 9.0 GPU the bf16 D = 64 forward is attention_wgmma.cu's (sm_90a): it must be
    built there, and agree with the mma.sync kernel it replaces to bf16's rounding of the same float32 sums."""
    import cupy as cp

    from blutrain.kernels import cuda

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    assert cuda.hopper_module("attention_wgmma") is not None, "NVRTC did not build attention_wgmma.cu for sm_90a"
    q, k, v, _ = (dev(a, BF16) for a in _attn_data(bh, L, S, 64, BF16, 25))
    res = cuda.sdpa(q, k, v, None, causal, 0.125)
    assert res is not None
    args = (np.int32(L), np.int32(S), np.float32(0.125), np.int32(causal), np.int32(1),
            *(np.int64(x) for t in (q, k, v, q) for x in ((L if t is q else S) * 64, 0, 64)))  # (batch, head, row)
    out = cp.empty_like(q)
    lse = cp.empty((bh, L), np.float32)
    name, warps, rows = cuda._ATT_BF16_FWD[64, causal]
    cuda._launch("attention_bf16", f"attn_bf16_fwd_d64_{name}", ((L + rows - 1) // rows, bh), (32 * warps,),
                 (q, k, v, out, lse, *args), (rows + 4 * cuda._ATT_BF16_KEYS) * 64 * 2)
    got, ref = res[0].astype(np.float32), out.astype(np.float32)
    assert float(cp.abs(got - ref).max()) <= 2**-7 * float(cp.abs(ref).max()) + 1e-6
    np.testing.assert_allclose(cp.asnumpy(res[1]), cp.asnumpy(lse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_bfloat16_d64_backward_on_hopper_is_the_wgmma_kernels(causal: bool) -> None:
    """On compute capability 9.0 the bf16 D = 64 backward is attention_wgmma_bwd.cu's: built there, and within
    bf16's error of float64 at GPT-2's sequence length (the small shapes above take the same path)."""
    import cupy as cp

    from blutrain.kernels import cuda

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernels are built for compute capability 9.0 only")
    assert cuda.hopper_module("attention_wgmma_bwd") is not None, "NVRTC did not build attention_wgmma_bwd.cu"
    q, k, v, g = _attn_data(2, 1024, 1024, 64, BF16, 26)
    out, lse = cpu_nn.sdpa(q, k, v, None, causal, 0.125)
    out, lse = f64(out, BF16), f64(lse, np.float32)
    res = cuda.sdpa_backward(dev(g, BF16), dev(q, BF16), dev(k, BF16), dev(v, BF16), dev(out, BF16),
                             dev(lse, np.float32), None, causal, 0.125)
    assert res is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, out, lse, None, causal, 0.125)
    for got, ref in zip(res, refs, strict=True):
        check(got, ref, BF16, floor=1.0)


def test_flash_attention_bfloat16_handles_batch_head_dims_and_unaligned_inputs() -> None:
    from blutrain.kernels import cuda

    r = rng(23)
    q, k, v, g = (f64(r.standard_normal((2, 3, 90, 128)), BF16) for _ in range(4))

    def unaligned(a: np.ndarray[Any, Any]) -> Any:  # contiguous, but 2 bytes past a 16-byte boundary
        buf = dev(np.concatenate([np.zeros(1), a.ravel()]), BF16)
        return buf[1:].reshape(a.shape)

    res = cuda.sdpa(unaligned(q), unaligned(k), unaligned(v), None, True, 0.1)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, True, 0.1)
    check(res[0], rout, BF16)
    check(res[1], rlse, np.float32)
    out = f64(rout, BF16)
    grads = cuda.sdpa_backward(unaligned(g), unaligned(q), unaligned(k), unaligned(v), unaligned(out),
                               dev(rlse, np.float32), None, True, 0.1)
    assert grads is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, out, f64(rlse, np.float32), None, True, 0.1)
    for got, ref in zip(grads, refs, strict=True):
        check(got, ref, BF16, floor=1.0)


def test_flash_attention_bfloat16_backward_is_deterministic() -> None:
    from blutrain.kernels import cuda

    q, k, v, g = (dev(a, BF16) for a in _attn_data(4, 300, 300, 64, BF16, 24))
    res = cuda.sdpa(q, k, v, None, True, 0.125)
    assert res is not None
    first = cuda.sdpa_backward(g, q, k, v, res[0], res[1], None, True, 0.125)
    second = cuda.sdpa_backward(g, q, k, v, res[0], res[1], None, True, 0.125)
    assert first is not None and second is not None
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(host(a), host(b))


# Strided operands: the kernels take (batch, head, row) strides, so (B, H, T, D) views of [B, T, H, D] data
# and the three parts of a packed [B, T, 3C] projection are read (and the packed gradient written) in place.
# Odd lengths give tails on both sides; the results are the same bits as on contiguous copies.
ATTN_STRIDED_CASES = [(2, 3, 77), (1, 2, 200)]


def _bthd_view(a: np.ndarray[Any, Any], dtype: Any) -> Any:
    """(B, H, T, D) values as a transposed view of device data laid out [B, T, H, D]."""
    return dev(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), dtype).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("B", "H", "T"), ATTN_STRIDED_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_reads_transposed_bthd_views_in_place(dtype: Any, B: int, H: int, T: int, D: int,
                                                              causal: bool) -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(25)
    q, k, v, g = (f64(r.standard_normal((B, H, T, D)), dtype) for _ in range(4))
    views = [_bthd_view(a, dtype) for a in (q, k, v, g)]
    # read in place, no contiguous copy (a batch of one is never stepped over: its stride counts as 0)
    assert cuda._row_layout(views[0]) == (T * H * D if B > 1 else 0, D, H * D)
    res = cuda.sdpa(*views[:3], None, causal, D**-0.5)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, causal, D**-0.5)
    check(res[0], rout, dtype)
    check(res[1], rlse, np.float32)
    copies = [cp.ascontiguousarray(t) for t in views]
    same = cuda.sdpa(*copies[:3], None, causal, D**-0.5)
    assert same is not None
    assert np.array_equal(host(res[0]), host(same[0])) and np.array_equal(host(res[1]), host(same[1]))

    out = _bthd_view(host(res[0]), dtype)
    grads = cuda.sdpa_backward(views[3], *views[:3], out, res[1], None, causal, D**-0.5)
    assert grads is not None
    refs = cpu_nn.sdpa_backward(g, q, k, v, host(res[0]), host(res[1]), None, causal, D**-0.5)
    for got, ref in zip(grads, refs, strict=True):
        check(got, ref, dtype, floor=1.0)
    same_grads = cuda.sdpa_backward(copies[3], *copies[:3], cp.ascontiguousarray(out), res[1], None, causal,
                                    D**-0.5)
    assert same_grads is not None
    for a, b in zip(grads, same_grads, strict=True):
        assert np.array_equal(host(a), host(b))


def _packed_data(B: int, T: int, H: int, D: int, dtype: Any, seed: int) -> tuple[np.ndarray[Any, Any], ...]:
    r = rng(seed)
    return f64(r.standard_normal((B, T, 3 * H * D)), dtype), f64(r.standard_normal((B, T, H * D)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("B", "H", "T"), ATTN_STRIDED_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_self_attention_matches_float64(dtype: Any, B: int, H: int, T: int, D: int, causal: bool) -> None:
    from blutrain.kernels import cuda

    qkv, g = _packed_data(B, T, H, D, dtype, 26)
    scale = D**-0.5
    res = cuda.sdpa_packed(dev(qkv, dtype), H, causal, scale)
    assert res is not None
    ry, rlse = cpu_nn.sdpa_packed(qkv, H, causal, scale)
    check(res[0], ry, dtype)
    check(res[1], rlse, np.float32)
    y, lse = f64(ry, dtype), f64(rlse, np.float32)  # what the forward saved
    dqkv = cuda.sdpa_packed_backward(dev(g, dtype), dev(qkv, dtype), dev(y, dtype), dev(lse, np.float32), H, causal,
                                     scale)
    assert dqkv is not None and dqkv.dtype == dtype and dqkv.shape == qkv.shape
    check(dqkv, cpu_nn.sdpa_packed_backward(g, qkv, y, lse, H, causal, scale), dtype, floor=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("pad", [8, 1])
def test_packed_self_attention_reads_a_strided_projection_and_copies_only_a_misaligned_one(dtype: Any,
                                                                                         pad: int) -> None:
    from blutrain.kernels import cuda

    B, T, H, D = 2, 90, 2, 64
    qkv, g = _packed_data(B, T, H, D, dtype, 27)
    wide = np.concatenate([qkv, np.zeros((B, T, pad))], axis=2)  # rows 3C + pad elements apart
    view = dev(wide, dtype)[:, :, :3 * H * D]
    q = cuda._packed_heads(view, H)[0]
    assert (cuda._row_layout(q) is None) == (pad * np.dtype(dtype).itemsize % 16 != 0)
    res = cuda.sdpa_packed(view, H, True, 0.1)
    assert res is not None
    ry, rlse = cpu_nn.sdpa_packed(qkv, H, True, 0.1)
    check(res[0], ry, dtype)
    y, lse = f64(ry, dtype), f64(rlse, np.float32)
    dqkv = cuda.sdpa_packed_backward(dev(g, dtype), view, dev(y, dtype), dev(lse, np.float32), H, True, 0.1)
    assert dqkv is not None
    check(dqkv, cpu_nn.sdpa_packed_backward(g, qkv, y, lse, H, True, 0.1), dtype, floor=1.0)


def test_flash_attention_with_batch_dims_that_do_not_collapse_copies_and_stays_exact() -> None:
    import cupy as cp

    from blutrain.kernels import cuda

    r = rng(28)
    q, k, v = (f64(r.standard_normal((2, 3, 2, 40, 64)), np.float32) for _ in range(3))
    views = [dev(np.ascontiguousarray(a.transpose(1, 0, 2, 3, 4)), np.float32).transpose(1, 0, 2, 3, 4)
             for a in (q, k, v)]
    assert cuda._row_layout(views[0]) is None  # (2, 3) leading dims in the wrong memory order
    res = cuda.sdpa(*views, None, True, 0.125)
    assert res is not None
    rout, rlse = cpu_nn.sdpa(q, k, v, None, True, 0.125)
    check(res[0], rout, np.float32)
    check(res[1], rlse, np.float32)
    same = cuda.sdpa(*(cp.ascontiguousarray(t) for t in views), None, True, 0.125)
    assert same is not None and np.array_equal(host(res[0]), host(same[0]))


def test_packed_self_attention_leaves_other_head_dims_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    qkv = dev(np.ones((1, 4, 3 * 2 * 32), np.float32))
    assert cuda.sdpa_packed(qkv, 2, True, 1.0) is None
    assert cuda.sdpa_packed(qkv, 5, True, 1.0) is None  # 192 is not 3 * 5 heads wide


# ------------------------------------------------------------------------------------------- Philox


def test_philox_kernel_matches_the_reference_words() -> None:
    from blutrain.kernels import cuda
    from blutrain.kernels.cuda import philox_reference as ref

    words, used = cuda.philox("raw", 1000, 0x1234_5678_9ABC, 2**32 - 3)  # the counter crosses 32 bits
    assert used == 1000
    got = np.asarray(__import__("cupy").asnumpy(words)).reshape(-1, 4)
    assert np.array_equal(got, ref.philox_words(0x1234_5678_9ABC, 2**32 - 3, 1000))
    first, _ = cuda.philox("raw", 1, 0, 0)
    _, _, expected = ref.KNOWN_ANSWERS[0]
    assert tuple(int(x) for x in __import__("cupy").asnumpy(first)) == expected


def test_philox_uniform_integers_and_normal_match_the_reference() -> None:
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.kernels.cuda import philox_reference as ref

    u, used = cuda.philox("uniform_f32", 1001, 42, 17)
    assert used == 251
    assert np.array_equal(cp.asnumpy(u), ref.uniform_f32(42, 17, 1001))
    i, _ = cuda.philox("integers", 999, 42, 5, low=-7, high=1000)
    assert np.array_equal(cp.asnumpy(i), ref.integers(42, 5, 999, -7, 1000))
    z, _ = cuda.philox("normal_f32", 1003, 42, 9)
    check(z, ref.normal_f32(42, 9, 1003), np.float32, tol=1e-5)
    d, _ = cuda.philox("uniform_f64", 1001, 42, 9)
    got = cp.asnumpy(d)
    assert ((got >= 0) & (got < 1)).all() and abs(got.mean() - 0.5) < 0.05


# ------------------------------------------------------------------------------------------- casts
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
