"""Grouped-query attention on the flash-attention kernels: k and v with H / group heads, read in place as
transposed (B, T, H_kv, D) views, query head h reading key/value head h // group; dk and dv summed over each
group by the dk/dv kernels themselves (no repeated k or v). Against float64 attention with the key/value heads
repeated explicitly. bf16 D = 64 runs the wgmma kernels on compute capability 9.0 and the mma.sync ones
elsewhere; ``mma_sync`` forces the latter on any GPU. Skipped without an NVIDIA GPU and CuPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_kernel_checks import BF16, DTYPES, assert_attention_backward_deterministic, check, dev, f64, host, rng

from blutrain.kernels.cuda import _attention
from blutrain.tensor.cpu import nn as cpu_nn

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory

# (B, H_kv, L, S): tails on both sides, several tiles per head; L < S (causal: top-left, the last keys unseen)
GQA_CASES = [(2, 2, 130, 130), (1, 1, 77, 77), (1, 2, 70, 200)]


def _bthd_view(a: np.ndarray[Any, Any], dtype: Any) -> Any:
    """(B, H, T, D) values as a transposed view of device data laid out [B, T, H, D], as a model's
    projections give them."""
    return dev(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), dtype).transpose(0, 2, 1, 3)


def _repeated_reference(q: np.ndarray[Any, Any], k: np.ndarray[Any, Any], v: np.ndarray[Any, Any],
                        g: np.ndarray[Any, Any], group: int, causal: bool,
                        scale: float) -> tuple[np.ndarray[Any, Any], ...]:
    """float64 out, lse, dq, dk, dv of attention over key/value heads repeated for each query head, dk and dv
    summed back over each group."""
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out, lse = cpu_nn.sdpa(q, kr, vr, None, causal, scale)
    dq, dk, dv = cpu_nn.sdpa_backward(g, q, kr, vr, out, lse, None, causal, scale)
    B, H_kv, S, D = k.shape
    return (out, lse, dq, dk.reshape(B, H_kv, group, S, D).sum(2), dv.reshape(B, H_kv, group, S, D).sum(2))


def _run(dtype: Any, B: int, H_kv: int, L: int, S: int, D: int, group: int, causal: bool, seed: int) -> None:
    from blutrain.kernels import cuda

    r = rng(seed)
    H = H_kv * group
    q, g = (f64(r.standard_normal((B, H, L, D)), dtype) for _ in range(2))
    k, v = (f64(r.standard_normal((B, H_kv, S, D)), dtype) for _ in range(2))
    scale = D**-0.5
    ref_out, ref_lse, *ref_grads = _repeated_reference(q, k, v, g, group, causal, scale)
    qv, kv, vv, gv = (_bthd_view(a, dtype) for a in (q, k, v, g))
    assert _attention._row_layout(kv) is not None, "k is read in place"
    res = cuda.sdpa(qv, kv, vv, None, causal, scale)
    assert res is not None
    check(res[0], ref_out, dtype)
    check(res[1], ref_lse, np.float32)
    grads = cuda.sdpa_backward(gv, qv, kv, vv, _bthd_view(host(res[0]), dtype), res[1], None, causal, scale)
    assert grads is not None
    assert grads[1].shape == (B, H_kv, S, D) and grads[2].shape == (B, H_kv, S, D)
    # the reference gradients from the kernel's own (bf16-rounded) output, as the kernel sees it
    refs = cpu_nn.sdpa_backward(g, q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), host(res[0]),
                                host(res[1]), None, causal, scale)
    want = (refs[0], *(d.reshape(B, H_kv, group, S, D).sum(2) for d in refs[1:]))
    for got, ref in zip(grads, want, strict=True):
        check(got, ref, dtype, floor=1.0)
    for got, ref in zip(grads, ref_grads, strict=True):  # and from the float64 output, to bf16's tolerance
        check(got, ref, dtype, tol=2e-2 if dtype == BF16 else 1e-5, floor=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("B", "H_kv", "L", "S"), GQA_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_matches_float64_with_repeated_heads(dtype: Any, B: int, H_kv: int, L: int, S: int,
                                                                     D: int, group: int, causal: bool) -> None:
    _run(dtype, B, H_kv, L, S, D, group, causal, 31)


@pytest.mark.parametrize(("B", "H_kv", "L", "S"), GQA_CASES)
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_bfloat16_d64_mma_sync_kernels(monkeypatch: pytest.MonkeyPatch, B: int, H_kv: int,
                                                               L: int, S: int, group: int, causal: bool) -> None:
    """The mma.sync bf16 kernels (attention_bf16.cu) at D = 64, which compute capability 9.0 replaces with the
    wgmma ones: forced by hiding the Hopper modules."""
    monkeypatch.setattr(_attention, "hopper_module", lambda family: None)
    _run(BF16, B, H_kv, L, S, 64, group, causal, 32)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_bfloat16_d64_at_llama_shapes(causal: bool) -> None:
    """Llama-1B's heads (32 query, 4 key/value, D 64) over 1024 positions: the wgmma kernels on Hopper."""
    _run(BF16, 1, 4, 1024, 1024, 64, 8, causal, 33)


def test_grouped_query_attention_backward_is_deterministic() -> None:
    r = rng(34)
    q, g = (dev(f64(r.standard_normal((2, 16, 300, 64)), BF16), BF16) for _ in range(2))
    k, v = (dev(f64(r.standard_normal((2, 2, 300, 64)), BF16), BF16) for _ in range(2))
    assert_attention_backward_deterministic(q, k, v, g)


def test_key_value_heads_that_do_not_divide_the_query_heads_go_to_the_generic_kernel() -> None:
    from blutrain.kernels import cuda

    q, k = dev(np.zeros((1, 6, 8, 64)), np.float32), dev(np.zeros((1, 4, 8, 64)), np.float32)
    assert cuda.sdpa(q, k, k, None, False, 0.125) is None
