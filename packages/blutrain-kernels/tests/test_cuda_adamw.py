"""adamw.cu's multi-tensor AdamW step (with the global-norm clip, the grad scale, captured graphs) against the
float64 reference, and its refusals of bad arguments.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, DTYPES, check, dev, f64, rng

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


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
