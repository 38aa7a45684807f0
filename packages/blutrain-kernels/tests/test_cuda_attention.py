"""The flash-attention kernels (attention.cu, attention_bf16.cu and, on compute capability 9.0, the wgmma
ones) against the float64 CPU references: separate, transposed and packed q, k, v.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, DTYPES, assert_attention_backward_deterministic, check, dev, f64, host, rng

from blutrain.kernels.cuda import _attention
from blutrain.tensor.cpu import nn as cpu_nn

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


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
    args = (np.int32(L), np.int32(S), np.float32(0.125), np.int32(causal), np.int32(1), np.int32(1),  # H, group
            *(np.int64(x) for t in (q, k, v, q) for x in ((L if t is q else S) * 64, 0, 64)))  # (batch, head, row)
    out = cp.empty_like(q)
    lse = cp.empty((bh, L), np.float32)
    name, warps, rows = _attention._ATT_BF16_FWD[64, causal]
    _attention._launch("attention_bf16", f"attn_bf16_fwd_d64_{name}", ((L + rows - 1) // rows, bh), (32 * warps,),
                 (q, k, v, out, lse, *args), (rows + 4 * _attention._ATT_BF16_KEYS) * 64 * 2)
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
    q, k, v, g = (dev(a, BF16) for a in _attn_data(4, 300, 300, 64, BF16, 24))
    assert_attention_backward_deterministic(q, k, v, g)


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
    assert _attention._row_layout(views[0]) == (T * H * D if B > 1 else 0, D, H * D)
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
    q = _attention._packed_heads(view, H)[0]
    assert (_attention._row_layout(q) is None) == (pad * np.dtype(dtype).itemsize % 16 != 0)
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
    assert _attention._row_layout(views[0]) is None  # (2, 3) leading dims in the wrong memory order
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
