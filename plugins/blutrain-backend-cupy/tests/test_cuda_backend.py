"""The "cuda" device on a GPU: copies, random streams, streams and events, GEMM precision, and ops
through the public tensor API against the same ops on the CPU. Skipped without a GPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.kernels import cuda as fused
from blutrain.kernels.cuda import philox_reference
from blutrain.tensor import dispatch
from blutrain.tensor.backend import get_backend
from blutrain.tensor.kernel import kernels
from blutrain.tensor.tensor import Tensor
from blutrain_backend_cupy import Event, Stream, cuda, current_stream, stream

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda.is_available(), reason="needs an NVIDIA GPU and CuPy")]


def host(t: Tensor) -> np.ndarray[Any, Any]:
    return np.asarray(t.detach().cpu().numpy()).astype(np.float64)


def rel(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(got: Tensor, want: Tensor, tol: float) -> None:
    assert got.device.type == "cuda"
    assert got.shape == want.shape and got.dtype is want.dtype
    g, w = host(got), host(want)
    assert np.array_equal(np.isnan(g), np.isnan(w))
    fin = np.isfinite(w)
    assert np.array_equal(g[~fin], w[~fin])
    assert rel(g[fin], w[fin]) <= tol, f"relative error {rel(g[fin], w[fin]):.3g}"


# ------------------------------------------------------------------------------------------- copies


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16", "int64", "int8", "uint8", "bool"])
def test_a_round_trip_through_the_gpu_is_exact(dtype: str) -> None:
    a = np.random.default_rng(0).standard_normal((7, 33)) * 50
    if not bt.as_dtype(dtype).is_floating:
        a = np.abs(a) % 100  # in range of every integer type
    arr = a.astype(bt.as_dtype(dtype).np)
    t = bt.tensor(arr, device="cuda")
    assert t.device.type == "cuda" and t.dtype is bt.as_dtype(dtype)
    assert np.array_equal(t.cpu().numpy(), arr)


def test_large_copies_to_the_host_are_exact() -> None:
    a = np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)  # 4 MiB: the pinned path
    t = bt.tensor(a, device="cuda")
    back = get_backend("cuda").to_host(t.array[::2])  # a strided view too
    assert np.array_equal(back, a[::2])
    assert np.array_equal(t.cpu().numpy(), a)


def test_empty_allocates_on_the_requested_gpu() -> None:
    backend = get_backend("cuda")
    arr = backend.empty((3, 4), bt.float32, 0)
    assert arr.shape == (3, 4) and backend.device_index(arr) == 0
    assert backend.data_ptr(arr) == arr.data.ptr


def test_dlpack_import_keeps_the_tensor_on_the_gpu() -> None:
    import cupy as cp

    t = bt.from_dlpack(cp.arange(5, dtype=cp.float32))
    assert t.device.type == "cuda" and t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


# ------------------------------------------------------------------------------------------- random


def test_manual_seed_makes_cuda_random_tensors_reproducible() -> None:
    bt.manual_seed(7)
    a = host(bt.rand(1000, device="cuda"))
    b = host(bt.randn(10, device="cuda"))
    bt.manual_seed(7)
    assert np.array_equal(host(bt.rand(1000, device="cuda")), a)
    assert np.array_equal(host(bt.randn(10, device="cuda")), b)
    assert not np.array_equal(host(bt.rand(1000, device="cuda")), a)


def test_generator_state_round_trips_through_json() -> None:
    gen = get_backend("cuda").generator(0)
    gen.seed(5)
    gen.uniform((10,), bt.float32)
    state = json.loads(json.dumps(gen.get_state()))
    x = host(bt.randn(100, device="cuda"))
    gen.set_state(state)
    assert np.array_equal(host(bt.randn(100, device="cuda")), x)


def test_uniform_draws_follow_the_philox_reference() -> None:
    gen = get_backend("cuda").generator(0)
    gen.seed(11)
    gen.uniform((5,), bt.float32)
    offset = gen.get_state()["offset"]
    assert offset == 2
    u = gen.uniform((1001,), bt.float32)
    import cupy as cp

    assert np.array_equal(cp.asnumpy(u), philox_reference.uniform_f32(11, offset, 1001))
    assert gen.get_state()["offset"] == offset + 251


def test_random_distributions_have_the_right_moments() -> None:
    bt.manual_seed(3)
    z = host(bt.randn(1_000_000, device="cuda"))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    u = host(bt.rand(1_000_000, device="cuda"))
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    i = host(bt.randint(-3, 10, (100_000,), device="cuda"))
    assert set(np.unique(i).tolist()) == set(range(-3, 10))
    assert bt.rand(4, dtype="float64", device="cuda").dtype is bt.float64
    assert bt.randn(4, dtype="bfloat16", device="cuda").dtype is bt.bfloat16


def test_dropout_draws_its_mask_from_the_device_generator() -> None:
    x = bt.ones(10_000, device="cuda")
    bt.manual_seed(1)
    a = host(bt.dropout(x, 0.25))
    bt.manual_seed(1)
    b = host(bt.dropout(x, 0.25))
    assert np.array_equal(a, b)
    assert abs((a == 0).mean() - 0.25) < 0.02 and np.allclose(a[a != 0], 1 / 0.75)


# ------------------------------------------------------------------------------------------- streams, events


def test_work_inside_a_stream_block_runs_on_that_stream() -> None:
    x = bt.randn(512, 512, device="cuda")
    s = Stream()
    with stream(s) as active:
        assert active is s and current_stream().ptr == s.ptr
        start, end = Event(), Event()
        start.record(s)
        y = x @ x
        end.record(s)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    other = Stream()
    other.wait_stream(s)
    other.synchronize()
    assert s.query()
    assert np.allclose(host(y), host(x) @ host(x), rtol=1e-4, atol=1e-3)


def test_synchronize_waits_for_every_gpu() -> None:
    bt.randn(1000, device="cuda").sum()
    cuda.synchronize()
    cuda.synchronize(0)


# ------------------------------------------------------------------------------------------- GEMM precision


def test_float32_matmul_is_strict_unless_tf32_is_asked_for() -> None:
    r = np.random.default_rng(2)
    a, b = r.standard_normal((256, 4096)).astype(np.float32), r.standard_normal((4096, 256)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    ta, tb = bt.tensor(a, device="cuda"), bt.tensor(b, device="cuda")
    assert not cuda.tf32_enabled()
    assert rel(host(ta @ tb), ref) < 1e-5
    cuda.set_tf32(True)
    try:
        assert rel(host(ta @ tb), ref) < 5e-3
    finally:
        cuda.set_tf32(False)
    assert rel(host(ta @ tb), ref) < 1e-5


def test_bfloat16_matmul_accumulates_in_float32() -> None:
    r = np.random.default_rng(3)
    a = r.standard_normal((128, 4096)).astype(bt.bfloat16.np)
    b = r.standard_normal((4096, 128)).astype(bt.bfloat16.np)
    out = bt.tensor(a, device="cuda") @ bt.tensor(b, device="cuda")
    assert out.dtype is bt.bfloat16
    assert rel(host(out), a.astype(np.float64) @ b.astype(np.float64)) < 1e-2


@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("operands", "result"), [("float32", "float32"), ("bfloat16", "float32"),
                                                   ("bfloat16", "bfloat16")])
def test_gemm_into_multiplies_row_major_matrices_and_accumulates(trans_a: bool, trans_b: bool, operands: str,
                                                                   result: str) -> None:
    import cupy as cp

    from blutrain_backend_cupy import gemm

    r = np.random.default_rng(4)
    m, k, n = 67, 130, 45
    a = r.standard_normal((k, m) if trans_a else (m, k)).astype(bt.as_dtype(operands).np)
    b = r.standard_normal((n, k) if trans_b else (k, n)).astype(bt.as_dtype(operands).np)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    out = cp.empty((m, n), bt.as_dtype(result).np)
    gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b)
    tol = 1e-5 if result == "float32" else 1e-2
    assert rel(cp.asnumpy(out).astype(np.float64), want) < tol
    gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b, accumulate=True)
    assert rel(cp.asnumpy(out).astype(np.float64), 2 * want) < tol
    with pytest.raises(ValueError, match="does not fit out"):
        gemm.gemm_into(cp.asarray(a), cp.asarray(b), cp.empty((m + 1, n), np.float32), trans_a=trans_a,
                       trans_b=trans_b)


@pytest.mark.parametrize("epilogue", [False, True])
def test_gemms_planned_for_fewer_sms_give_the_same_products(epilogue: bool) -> None:
    """With an SM carve-out cuBLAS (SM count target) and cuBLASLt (a plan of its own per target) choose
    algorithms for fewer SMs; the products are the same to float32 rounding, and 0 plans for every SM again."""
    import cupy as cp

    from blutrain_backend_cupy import gemm

    r = np.random.default_rng(5)
    a = cp.asarray(r.standard_normal((512, 384)).astype(bt.bfloat16.np))
    b = cp.asarray(r.standard_normal((384, 640)).astype(bt.bfloat16.np))
    bias = cp.asarray(r.standard_normal(640).astype(np.float32)) if epilogue else None
    want = cp.asnumpy(a).astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
    if bias is not None:
        want += cp.asnumpy(bias)
    try:
        for sms in (24, 0):
            gemm.set_gemm_sm_carveout(sms)
            out = cp.empty((512, 640), np.float32)
            gemm.gemm_into(a, b, out, bias=bias)
            assert rel(cp.asnumpy(out).astype(np.float64), want) < 1e-5, sms
    finally:
        gemm.set_gemm_sm_carveout(0)


def test_a_reservation_plans_the_next_gemms_for_fewer_sms_and_then_every_sm_again() -> None:
    """``Backend.reserve_sms``: the next ``products`` GEMMs on the device (cuBLAS's plain GEMM and cuBLASLt's with
    a bias) are planned for fewer SMs and give the same products; then the reservation is spent."""
    import cupy as cp

    from blutrain_backend_cupy import gemm

    r = np.random.default_rng(6)
    a = cp.asarray(r.standard_normal((512, 384)).astype(bt.bfloat16.np))
    b = cp.asarray(r.standard_normal((384, 640)).astype(bt.bfloat16.np))
    bias = cp.asarray(r.standard_normal(640).astype(np.float32))
    want = cp.asnumpy(a).astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
    dev = int(cp.cuda.runtime.getDevice())
    try:
        get_backend("cuda").reserve_sms(dev, 24, 2)
        for with_bias in (False, True):
            out = cp.empty((512, 640), np.float32)
            gemm.gemm_into(a, b, out, bias=bias if with_bias else None)
            assert rel(cp.asnumpy(out).astype(np.float64), want + (cp.asnumpy(bias) if with_bias else 0)) < 1e-5
        assert dev not in gemm._RESERVED  # two plans made: spent
        assert gemm._sm_target(dev) == 0
    finally:
        gemm.reserve_sms(dev, 0, 0)


@pytest.mark.parametrize("fp32_gemm", ["cublas", "3xtf32"])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, True), (True, False)])
@pytest.mark.parametrize(("operands", "result"), [("float32", "float32"), ("bfloat16", "float32"),
                                                   ("bfloat16", "bfloat16")])
def test_gemm_into_adds_bias_and_addend_in_the_epilogue(trans_a: bool, trans_b: bool, operands: str, result: str,
                                                         fp32_gemm: str) -> None:
    """``out = addend + op(a) op(b) + bias`` through cuBLASLt (or the 3xTF32 kernel and adds), against
    float64; a bias at an odd address (a vector inside a flat buffer) and an addend that is out itself."""
    import cupy as cp

    from blutrain_backend_cupy import gemm

    r = np.random.default_rng(6)
    m, k, n = 67, 130, 45
    a = r.standard_normal((k, m) if trans_a else (m, k)).astype(bt.as_dtype(operands).np)
    b = r.standard_normal((n, k) if trans_b else (k, n)).astype(bt.as_dtype(operands).np)
    bias = r.standard_normal(n).astype(bt.as_dtype(result).np)
    addend = r.standard_normal((m, n)).astype(bt.as_dtype(result).np)
    prod = (a.astype(np.float64).T if trans_a else a.astype(np.float64)) @ (
        b.astype(np.float64).T if trans_b else b.astype(np.float64))
    want = prod + bias.astype(np.float64) + addend.astype(np.float64)
    tol = 1e-5 if result == "float32" else 1e-2
    flat = cp.asarray(np.concatenate([np.zeros(1, bias.dtype), bias]))
    before = gemm.fp32_gemm()
    gemm.set_fp32_gemm(fp32_gemm)
    try:
        for bias_dev in (cp.asarray(bias), flat[1:]):
            out = cp.full((m, n), np.nan, bt.as_dtype(result).np)
            gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b, bias=bias_dev,
                           addend=cp.asarray(addend))
            assert rel(cp.asnumpy(out).astype(np.float64), want) < tol
        out = cp.asarray(addend)
        gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b, addend=out)
        assert rel(cp.asnumpy(out).astype(np.float64), prod + addend.astype(np.float64)) < tol
        out = cp.empty((m, n), bt.as_dtype(result).np)
        gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b, bias=cp.asarray(bias))
        assert rel(cp.asnumpy(out).astype(np.float64), prod + bias.astype(np.float64)) < tol
    finally:
        gemm.set_fp32_gemm(before)
    with pytest.raises(ValueError, match="bias must be"):
        gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b,
                       bias=cp.zeros(n + 1, out.dtype))
    with pytest.raises(ValueError, match="addend must be"):
        gemm.gemm_into(cp.asarray(a), cp.asarray(b), out, trans_a=trans_a, trans_b=trans_b,
                       addend=cp.zeros((m, n + 1), out.dtype))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gelu_matches_float64_on_the_cpu(autocast: bool, bias: bool, approximate: str) -> None:
    """An MLP's c_fc and GELU as one op (bf16 under autocast: cuBLASLt's bias+GELU epilogue for the tanh
    form), forward and every gradient, against the float64 CPU op; the pre-activation kept for backward."""
    r = np.random.default_rng(8)
    lead, c_in, c_out = (3, 50), 96, 256
    arrays = [r.standard_normal((*lead, c_in)), r.standard_normal((c_out, c_in)) * 0.2, r.standard_normal(c_out)]
    results = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float64")):
        ts = [bt.tensor(a, device=device, dtype=dtype, requires_grad=True) for a in arrays]
        if not bias:
            ts[2] = None
        with bt.autocast(enabled=autocast and device == "cuda"):
            out = bt.linear_gelu(*ts, approximate=approximate)
        (out.float() * bt.tensor(arrays[0][..., :1], device=device, dtype=dtype)).sum().backward()
        results.append([host(out), *(host(t.grad) for t in ts if t is not None)])
        if device == "cuda":
            assert out.dtype is (bt.bfloat16 if autocast else bt.float32)
            assert all(t.grad.dtype is bt.float32 for t in ts if t is not None)
    tol = 1e-2 if autocast else 1e-5
    for got, want in zip(*results, strict=True):
        assert rel(got, want) < tol


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_add_matches_float64_on_the_cpu(autocast: bool, bias: bool) -> None:
    """The transformer block's projection with its residual, forward and every gradient, against the
    float64 CPU op; under autocast the product is bf16 and the residual, bias and result float32."""
    r = np.random.default_rng(7)
    lead, c_in, c_out = (3, 50), 96, 64
    arrays = [r.standard_normal((*lead, c_out)), r.standard_normal((*lead, c_in)),
              r.standard_normal((c_out, c_in)) * 0.2, r.standard_normal(c_out)]
    results = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float64")):
        ts = [bt.tensor(a, device=device, dtype=dtype, requires_grad=True) for a in arrays]
        if not bias:
            ts[3] = None
        with bt.autocast(enabled=autocast and device == "cuda"):
            out = bt.linear_add(*ts)
        (out * out).sum().backward()
        results.append([host(out), *(host(t.grad) for t in ts if t is not None)])
        if device == "cuda":
            assert out.dtype is bt.float32 and all(t.grad.dtype is bt.float32 for t in ts if t is not None)
    tol = 1e-2 if autocast else 1e-5
    for got, want in zip(*results, strict=True):
        assert rel(got, want) < tol


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 100, 257])
def test_linear_cross_entropy_matches_float64_on_the_cpu(autocast: bool, chunk: int | None) -> None:
    """The cuBLAS chunked head and loss (bf16 GEMMs under autocast) against the float64 CPU op: loss and
    the input and weight gradients, some targets ignored, an upstream gradient of 0.5."""
    r = np.random.default_rng(5)
    n, c, v = 300, 64, 1000
    x, w = r.standard_normal((n, c)).astype(np.float32), (r.standard_normal((v, c)) * 0.2).astype(np.float32)
    target = r.integers(0, v, n)
    target[r.random(n) < 0.1] = -1
    results = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float64")):
        xt = bt.tensor(x, device=device, dtype=dtype, requires_grad=True)
        wt = bt.tensor(w, device=device, dtype=dtype, requires_grad=True)
        with bt.autocast(enabled=autocast and device == "cuda"):
            loss = bt.linear_cross_entropy(xt, wt, bt.tensor(target, device=device), ignore_index=-1,
                                           label_smoothing=0.1, chunk_size=chunk)
        (loss * 0.5).backward()
        assert xt.grad is not None and wt.grad is not None
        results.append([host(t) for t in (loss, xt.grad, wt.grad)])
        if device == "cuda":
            assert loss.dtype is bt.float32 and xt.grad.dtype is bt.float32 and wt.grad.dtype is bt.float32
    tol = 1e-2 if autocast else 1e-5
    for got, want in zip(*results, strict=True):
        assert rel(got, want) < tol


def test_linear_cross_entropy_casts_its_operands_with_the_cast_kernel_bit_for_bit() -> None:
    """Under autocast the op's float32 x and weight become bf16 through BluTrain's cast kernel: the CPU's
    astype bits, NaNs as the quiet NaN of their sign, ties to even; an F-order operand comes back C-order, a
    bf16 one is not copied."""
    import cupy as cp

    from blutrain_backend_cupy.gemm import _compute_operand

    bf16 = np.dtype(bt.bfloat16.np)
    special = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
                        0xFFA00000, 0x00000001, 0x80000000], np.uint32).view(np.float32)
    a = np.random.default_rng(11).standard_normal((257, 96)).astype(np.float32)
    a.reshape(-1)[:special.size] = special
    for host_a in (a, np.asfortranarray(a)):
        got = _compute_operand(cp.asarray(host_a), bf16)
        assert got.dtype == bf16 and got.flags.c_contiguous
        np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint16), a.astype(bf16).view(np.uint16))
    already = cp.asarray(a.astype(bf16))
    assert _compute_operand(already, bf16).data.ptr == already.data.ptr


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_cross_entropy_default_chunks_are_the_balanced_ones(monkeypatch: pytest.MonkeyPatch,
                                                                   autocast: bool) -> None:
    """With a logits budget of 120 rows, 300 rows run as three chunks of 100 (default_chunk_rows), not 120 +
    120 + 60: the default call's loss and gradients are chunk_size=100's bit for bit, and the float64 op's
    to the usual tolerance."""
    from blutrain.tensor.ops import nn

    r = np.random.default_rng(6)
    n, c, v = 300, 64, 1000
    x, w = r.standard_normal((n, c)).astype(np.float32), (r.standard_normal((v, c)) * 0.2).astype(np.float32)
    target = r.integers(0, v, n)
    target[r.random(n) < 0.1] = -1
    itemsize = 2 if autocast else 4
    monkeypatch.setattr(nn, "LOGITS_CHUNK_BYTES", 120 * v * itemsize)
    assert nn.default_chunk_rows(n, v, itemsize) == 100
    results = []
    for device, dtype, chunk in (("cuda", "float32", None), ("cuda", "float32", 100), ("cpu", "float64", 7)):
        xt = bt.tensor(x, device=device, dtype=dtype, requires_grad=True)
        wt = bt.tensor(w, device=device, dtype=dtype, requires_grad=True)
        with bt.autocast(enabled=autocast and device == "cuda"):
            loss = bt.linear_cross_entropy(xt, wt, bt.tensor(target, device=device), ignore_index=-1,
                                           chunk_size=chunk)
        loss.backward()
        assert xt.grad is not None and wt.grad is not None
        results.append([host(t) for t in (loss, xt.grad, wt.grad)])
    for default, explicit, want in zip(*results, strict=True):
        np.testing.assert_array_equal(default, explicit)  # float32 widened exactly: equal bits
        assert rel(default, want) < (1e-2 if autocast else 1e-5)


# ------------------------------------------------------------------------------------------- ops against the CPU


def _inputs(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    r = np.random.default_rng(seed)
    return {
        "x": r.standard_normal((6, 64)).astype(np.float32),
        "y": r.standard_normal((6, 64)).astype(np.float32),
        "row": r.standard_normal((64,)).astype(np.float32),
        "w": r.standard_normal((48, 64)).astype(np.float32),
        "b": r.standard_normal((48,)).astype(np.float32),
        "q": r.standard_normal((2, 3, 17, 64)).astype(np.float32),
        "k": r.standard_normal((2, 3, 21, 64)).astype(np.float32),
        "v": r.standard_normal((2, 3, 21, 64)).astype(np.float32),
        "mask": r.random((17, 21)) > 0.3,
        "table": r.standard_normal((30, 64)).astype(np.float32),
        "ids": r.integers(0, 30, (4, 5)),
        "target": np.where(r.random(6) < 0.2, -100, r.integers(0, 48, 6)),
        "idx": r.integers(0, 6, (6, 64)),
    }


Case = Callable[[dict[str, Tensor]], Tensor]
OPS: dict[str, Case] = {
    "add": lambda t: t["x"] + t["y"],
    "mul_broadcast": lambda t: t["x"] * t["row"],
    "exp": lambda t: t["x"].exp(),
    "tanh": lambda t: bt.tanh(t["x"]),
    "sigmoid": lambda t: bt.sigmoid(t["x"]),
    "erf": lambda t: bt.erf(t["x"]),
    "gelu": lambda t: bt.gelu(t["x"]),
    "gelu_tanh": lambda t: bt.gelu(t["x"], approximate="tanh"),
    "sum_dim0": lambda t: bt.sum(t["x"], 0),
    "sum_dim1": lambda t: bt.sum(t["x"], 1, keepdim=True),
    "sum_all": lambda t: bt.sum(t["x"]),
    "mean": lambda t: bt.mean(t["x"], 1),
    "var": lambda t: bt.var(t["x"], 0),
    "amax": lambda t: bt.amax(t["x"], 1),
    "argmax": lambda t: bt.argmax(t["x"], 1),
    "softmax_last": lambda t: bt.softmax(t["x"], -1),
    "softmax_first": lambda t: bt.softmax(t["x"], 0),
    "log_softmax": lambda t: bt.log_softmax(t["x"], -1),
    "logsumexp": lambda t: bt.logsumexp(t["x"], 1),
    "matmul": lambda t: t["x"] @ t["w"].T,
    "linear": lambda t: bt.linear(t["x"], t["w"], t["b"]),
    "layer_norm": lambda t: bt.layer_norm(t["x"], 64, t["row"], t["row"]),
    "rms_norm": lambda t: bt.rms_norm(t["x"], 64, t["row"]),
    "cross_entropy": lambda t: bt.cross_entropy(bt.linear(t["x"], t["w"]), t["target"]),
    "sdpa_causal": lambda t: bt.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True),
    "sdpa_mask": lambda t: bt.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"]),
    # grouped-query attention: one key/value head shared by q's 3 (the fused kernels; with a mask, the generic one)
    "sdpa_gqa_causal": lambda t: bt.scaled_dot_product_attention(t["q"], t["k"][:, :1], t["v"][:, :1],
                                                                 is_causal=True, enable_gqa=True),
    "sdpa_gqa_mask": lambda t: bt.scaled_dot_product_attention(t["q"], t["k"][:, :1], t["v"][:, :1],
                                                               attn_mask=t["mask"], enable_gqa=True),
    "embedding": lambda t: bt.embedding(t["ids"], t["table"]),
    "cat": lambda t: bt.cat([t["x"], t["y"]], 1),
    "where_scalar": lambda t: bt.where(t["x"] > 0, t["x"], 0.5),
    "clamp_min": lambda t: bt.clamp(t["x"], min=-0.5),
    "clamp_max": lambda t: bt.clamp(t["x"], max=0.5),
    "tril": lambda t: bt.tril(t["x"]),
    "gather": lambda t: bt.gather(t["x"], 0, t["idx"]),
    "scatter_add": lambda t: bt.scatter_add(t["x"], 0, t["idx"], t["y"]),
    "index_add": lambda t: bt.index_add(t["x"], 0, t["idx"][:, 0], t["y"]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_on_cuda_matches_the_cpu(name: str) -> None:
    data = _inputs(4)
    cpu = {k: bt.tensor(v) for k, v in data.items()}
    gpu = {k: bt.tensor(v, device="cuda") for k, v in data.items()}
    want, got = OPS[name](cpu), OPS[name](gpu)
    assert_close(got, want, 1e-5 if got.dtype.is_floating else 0.0)


@pytest.mark.parametrize("name", ["add", "exp", "gelu_tanh", "sum_dim0", "softmax_last", "layer_norm", "matmul",
                                  "linear", "cross_entropy", "sdpa_causal", "sdpa_gqa_causal", "embedding"])
def test_bfloat16_op_on_cuda_matches_the_cpu(name: str) -> None:
    data = _inputs(5)
    cpu = {k: bt.tensor(v).to(dtype="bfloat16") if v.dtype == np.float32 else bt.tensor(v) for k, v in data.items()}
    gpu = {k: t.to(device="cuda") for k, t in cpu.items()}
    assert_close(OPS[name](gpu), OPS[name](cpu), 2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention_gradients_on_cuda_match_the_cpu(dtype: str, masked: bool) -> None:
    """dq, dk, dv of enable_gqa attention (2 key/value heads for 6 query heads) in key and value's own shapes."""
    r = np.random.default_rng(6)
    data = {"q": r.standard_normal((2, 6, 17, 64)), "k": r.standard_normal((2, 2, 21, 64)),
            "v": r.standard_normal((2, 2, 21, 64)), "g": r.standard_normal((2, 6, 17, 64))}
    mask = r.random((17, 21)) > 0.3
    grads = []
    for device in ("cpu", "cuda"):
        t = {k: bt.tensor(v.astype(np.float32), device=device).to(dtype=dtype) for k, v in data.items()}
        q, k, v = (t[n].requires_grad_() for n in ("q", "k", "v"))
        kw: dict[str, Any] = {"attn_mask": bt.tensor(mask, device=device)} if masked else {"is_causal": True}
        bt.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw).backward(t["g"])
        grads.append([x.grad for x in (q, k, v)])
    for want, got in zip(*grads, strict=True):  # grads: the cpu run's, then the cuda run's
        assert got is not None and want is not None
        assert_close(got, want, 1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int8", "int64", "uint8", "bool"])
def test_index_put_accumulate_sums_repeated_indices(dtype: str) -> None:
    idx = np.array([0, 1, 1, 3, 3, 3, 4])
    vals = np.array([1, 2, 3, 4, 5, 6, 120]).astype(bt.as_dtype(dtype).np)
    out = []
    for dev in ("cpu", "cuda"):
        x = bt.full((5,), 100 if dtype != "bool" else 0, dtype=dtype, device=dev)
        bt.index_put_(x, (bt.tensor(idx, device=dev),), bt.tensor(vals, device=dev), accumulate=True)
        out.append(x.cpu().numpy())
    assert np.array_equal(out[0], out[1]), out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "int64", "bool"])
def test_factories_on_cuda_match_the_cpu(dtype: str) -> None:
    for make in (lambda d: bt.full((3, 4), 2, dtype=dtype, device=d),
                 lambda d: bt.zeros(5, dtype=dtype, device=d),
                 lambda d: bt.eye(3, 4, dtype=dtype, device=d)):
        assert np.array_equal(make("cuda").cpu().numpy(), make("cpu").numpy())
    if dtype != "bool":
        assert np.array_equal(bt.arange(0, 10, 3, dtype=dtype, device="cuda").cpu().numpy(),
                              bt.arange(0, 10, 3, dtype=dtype).numpy())
    if dtype in ("float32", "bfloat16"):
        assert np.array_equal(bt.linspace(0, 1, 7, dtype=dtype, device="cuda").cpu().numpy(),
                              bt.linspace(0, 1, 7, dtype=dtype).numpy())


# ------------------------------------------------------------------------------------------- registration


def test_fused_kernels_win_for_float32_and_bfloat16_only() -> None:
    reg = kernels()
    assert reg.lookup("layer_norm", "cuda", bt.float32).priority == 10
    assert reg.lookup("sdpa_backward", "cuda", bt.bfloat16).priority == 10
    assert reg.lookup("layer_norm", "cuda", bt.float16).priority == 0
    assert dispatch.kernel("adamw_multi_tensor", "cuda", bt.float32) is fused.adamw_multi_tensor


_FLOATS = ("float32", "bfloat16", "float16")


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in _FLOATS for d in _FLOATS if s != d])
def test_casts_between_float_dtypes_on_cuda_equal_the_cpu_bit_for_bit(src: str, dst: str) -> None:
    assert kernels().lookup("cast", "cuda", bt.as_dtype(src)).priority == 10  # the cast kernels of casts.cu
    r = np.random.default_rng(7)
    with np.errstate(invalid="ignore", over="ignore"):  # NaNs and overflow flag NumPy's conversions
        patterns = r.integers(0, 2**32, (37, 61), dtype=np.uint32).view(np.float32).astype(bt.as_dtype(src).np)
        values = (r.standard_normal((37, 61)) * 100).astype(np.float32).astype(bt.as_dtype(src).np)
        for host_array in (patterns, values):  # every class of value (NaNs, subnormals...), then plain ones
            c, g = bt.tensor(host_array), bt.tensor(host_array, device="cuda")
            for view in (lambda t: t, lambda t: t.T, lambda t: t[1:, ::3]):  # contiguous, transposed, strided
                want = view(c).to(dtype=dst).numpy()
                got = view(g).to(dtype=dst).cpu().numpy()
                assert got.dtype == want.dtype and got.shape == want.shape
                nan = np.isnan(want.astype(np.float32))
                assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
                if view(g).array.flags.c_contiguous or view(g).array.flags.f_contiguous:
                    nan[...] = False  # the cast kernels give NumPy's NaN bits too; CuPy's astype (strided) may not
                assert np.array_equal(got.view(f"u{got.itemsize}")[~nan], want.view(f"u{want.itemsize}")[~nan])


def test_gradients_of_a_small_block_on_cuda_match_the_cpu() -> None:
    pytest.importorskip("blutrain.autograd")
    data = _inputs(6)
    grads = []
    for dev in ("cpu", "cuda"):
        x = bt.tensor(data["x"], device=dev, requires_grad=True)
        w = bt.tensor(data["w"], device=dev, requires_grad=True)
        b = bt.tensor(data["b"], device=dev, requires_grad=True)
        g = bt.tensor(data["row"], device=dev, requires_grad=True)
        h = bt.gelu(bt.layer_norm(x, 64, g), approximate="tanh")
        loss = bt.cross_entropy(bt.linear(h, w, b), bt.tensor(data["target"], device=dev))
        loss.backward()
        grads.append([host(t.grad) for t in (x, w, b, g)])  # type: ignore[arg-type]
    for c, gpu in zip(*grads, strict=True):
        assert rel(gpu, c) < 1e-4


def test_cat_of_many_pieces_can_be_captured_into_a_cuda_graph() -> None:
    """CuPy's concatenate uploads the pieces' pointers from the host, which stream capture forbids; the cuda
    ``cat`` copies piece by piece while capturing, and the replayed graph gives the same result."""
    import cupy as cp

    from blutrain_backend_cupy import kernels

    pieces = [cp.full((2, 3), float(i), np.float32) for i in range(40)]
    want = cp.asnumpy(cp.concatenate(pieces, axis=1))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = kernels.cat(pieces, -1)
        graph = s.end_capture()
        for p in pieces:
            p += 1.0
        graph.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), want + 1.0)


def test_fp32_linear_through_the_3xtf32_kernel_keeps_float32_accuracy() -> None:
    """``set_fp32_gemm("3xtf32")``: GPT-2-sized linear forward and backward against float64, as accurate as
    strict cuBLAS (within 2x of its error)."""
    r = np.random.default_rng(6)
    x, w = r.standard_normal((1024, 768)).astype(np.float32), (r.standard_normal((2304, 768)) * 0.02).astype(np.float32)
    g = r.standard_normal((1024, 2304)).astype(np.float32)
    errors = {}
    for kind in ("cublas", "3xtf32"):
        cuda.set_fp32_gemm(kind)
        try:
            xt = bt.tensor(x, device="cuda", requires_grad=True)
            wt = bt.tensor(w, device="cuda", requires_grad=True)
            y = bt.linear(xt, wt)
            y.backward(bt.tensor(g, device="cuda"))
            assert xt.grad is not None and wt.grad is not None
            x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
            errors[kind] = [rel(host(y), x64 @ w64.T), rel(host(xt.grad), g64 @ w64), rel(host(wt.grad), g64.T @ x64)]
        finally:
            cuda.set_fp32_gemm("cublas")
    for ours, theirs in zip(errors["3xtf32"], errors["cublas"], strict=True):
        assert ours < 2e-6 and ours < 2 * theirs + 1e-7
