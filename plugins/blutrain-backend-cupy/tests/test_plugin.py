"""The plugin without a GPU: it imports, registers the "cuda" device and a kernel for every op, and
using the device raises an error that says why (runs on every machine; the GPU-less cases are
skipped where a GPU is visible)."""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest

import blutrain.tensor as bt
import blutrain_backend_cupy
from blutrain.kernels import cuda as fused
from blutrain.tensor.backend import get_backend
from blutrain.tensor.cpu import TABLE
from blutrain.tensor.kernel import KernelRegistry, kernels
from blutrain_backend_cupy import CudaUnavailableError, CupyBackend, cuda

no_gpu = pytest.mark.skipif(cuda.is_available(), reason="a GPU is visible: the unavailable path does not apply")


def test_entry_point_names_the_plugin_module() -> None:
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="blutrain")}
    assert eps.get("cuda") == "blutrain_backend_cupy"


def test_the_cuda_backend_is_registered_by_the_plugin() -> None:
    backend = get_backend("cuda")
    assert isinstance(backend, CupyBackend)
    assert backend is blutrain_backend_cupy.backend()
    assert backend.dlpack_device_type == 2


def test_every_cpu_op_has_a_cuda_kernel() -> None:
    # what this plugin registers, apart from the installed plugins that override one op at a higher
    # priority (the development environment has blutrain-kernels-example's gelu)
    registry = KernelRegistry()
    blutrain_backend_cupy.blutrain_register_kernels(registry)
    for op, (_, dtypes, _) in TABLE.items():
        for dt in dtypes:
            registry.lookup(op, "cuda", dt)  # raises KernelNotFoundError naming the op
    winners = {kernels().lookup(op, "cuda", dt).provider.plugin for op, (_, dts, _) in TABLE.items() for dt in dts}
    assert "cuda" in winners


def test_the_backend_chooses_the_deterministic_kernels_of_the_kernel_library() -> None:
    backend = get_backend("cuda")
    before = fused.is_deterministic()
    try:
        backend.set_deterministic(False)
        assert not fused.is_deterministic()
        backend.set_deterministic(True)
        assert fused.is_deterministic()
    finally:
        fused.set_deterministic(before)


def test_the_multi_tensor_adamw_op_is_registered_for_float32() -> None:
    assert "adamw_multi_tensor" in fused.STANDALONE
    assert kernels().lookup("adamw_multi_tensor", "cuda", bt.float32).provider.plugin == "cuda"


@no_gpu
def test_without_a_gpu_the_device_reports_itself_unavailable() -> None:
    backend = get_backend("cuda")
    assert backend.is_available() is False
    assert backend.device_count() == 0
    assert blutrain_backend_cupy.is_available() is False


@no_gpu
def test_without_a_gpu_creating_a_cuda_tensor_says_why() -> None:
    with pytest.raises(CudaUnavailableError, match="device 'cuda': "):
        bt.zeros(2, 3, device="cuda")
    with pytest.raises(CudaUnavailableError, match="device 'cuda': "):
        bt.tensor([1.0, 2.0], device="cuda")
    with pytest.raises(CudaUnavailableError, match="device 'cuda': "):
        bt.ones(2).to(device="cuda")


@no_gpu
def test_without_a_gpu_the_helper_namespace_says_why() -> None:
    assert cuda.device_count() == 0
    with pytest.raises(CudaUnavailableError, match="device 'cuda': "):
        cuda.synchronize()
    with pytest.raises(CudaUnavailableError):
        cuda.Event()


@no_gpu
def test_without_a_gpu_a_host_write_says_why() -> None:
    with pytest.raises(CudaUnavailableError, match="device 'cuda': "):
        get_backend("cuda").write_from_host(np.zeros(2), np.ones(2))


def test_a_host_write_staging_of_no_slots_is_refused() -> None:
    from blutrain_backend_cupy.host_writes import PinnedStaging

    with pytest.raises(ValueError, match=r"PinnedStaging: max_slots must be at least 1, got 0"):
        PinnedStaging(None, 0, max_slots=0)


@no_gpu
def test_manual_seed_leaves_an_unavailable_cuda_device_alone() -> None:
    bt.manual_seed(1234)  # seeds every available backend; must not touch the missing GPU
    assert bt.rand(3).shape == (3,)


def test_fp32_gemm_kind_is_cublas_by_default_and_an_unknown_kind_is_refused() -> None:
    from blutrain_backend_cupy import gemm

    assert gemm.fp32_gemm() == "cublas"
    with pytest.raises(ValueError, match=r"kind must be one of \('cublas', '3xtf32'\), got 'tf32'"):
        gemm.set_fp32_gemm("tf32")
    assert gemm.fp32_gemm() == "cublas"


def test_the_environment_sets_the_gemm_modes_only_where_it_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry loads at the first op: a mode chosen before it (set_fp32_gemm, set_tf32) must survive
    it unless the environment asks for another."""
    from blutrain_backend_cupy import gemm

    monkeypatch.delenv("BLUTRAIN_FP32_GEMM", raising=False)
    monkeypatch.delenv("CUPY_TF32", raising=False)
    assert gemm.fp32_gemm_requested_by_env() is None and gemm.tf32_requested_by_env() is None
    monkeypatch.setenv("BLUTRAIN_FP32_GEMM", "3xtf32")
    monkeypatch.setenv("CUPY_TF32", "0")
    assert gemm.fp32_gemm_requested_by_env() == "3xtf32" and gemm.tf32_requested_by_env() is False


def test_the_gemm_sm_carveout_is_off_by_default_and_refuses_what_is_not_a_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from blutrain_backend_cupy import gemm

    assert gemm.gemm_sm_carveout() == 0
    for bad in (-1, 2.5, True, "24"):
        with pytest.raises(ValueError, match="sms must be an int >= 0"):
            gemm.set_gemm_sm_carveout(bad)  # type: ignore[arg-type]
    assert gemm.gemm_sm_carveout() == 0
    monkeypatch.delenv("BLUTRAIN_GEMM_SM_CARVEOUT", raising=False)
    assert gemm.gemm_sm_carveout_requested_by_env() is None
    monkeypatch.setenv("BLUTRAIN_GEMM_SM_CARVEOUT", "24")
    assert gemm.gemm_sm_carveout_requested_by_env() == 24
    monkeypatch.setenv("BLUTRAIN_GEMM_SM_CARVEOUT", "all")
    with pytest.raises(ValueError, match="BLUTRAIN_GEMM_SM_CARVEOUT must be a number of SMs >= 0, got 'all'"):
        gemm.gemm_sm_carveout_requested_by_env()


def test_a_reservation_plans_the_next_products_for_fewer_sms_then_every_sm_again() -> None:
    """``reserve_sms`` counts plans: the next ``products`` GEMMs get the device's SMs less the reserved ones (or
    less the carve-out, whichever leaves fewer), then the target is 0 (every SM) again; a later reservation
    replaces the remainder of an earlier one, and 0 products cancels."""
    from blutrain_backend_cupy import gemm

    gemm._SM_COUNTS.setdefault(7, 132)  # a device index no test GPU has: its SM count given, no runtime asked
    try:
        assert gemm._sm_target(7) == 0
        gemm.reserve_sms(7, 24, 2)
        assert [gemm._sm_target(7) for _ in range(3)] == [108, 108, 0]
        gemm.reserve_sms(7, 24, 5)
        gemm.reserve_sms(7, 32, 1)
        assert [gemm._sm_target(7) for _ in range(2)] == [100, 0]
        gemm.reserve_sms(7, 24, 3)
        gemm.reserve_sms(7, 24, 0)
        assert gemm._sm_target(7) == 0
        gemm.set_gemm_sm_carveout(40)
        gemm.reserve_sms(7, 24, 1)
        assert [gemm._sm_target(7) for _ in range(2)] == [92, 92]
    finally:
        gemm.set_gemm_sm_carveout(0)
        gemm._RESERVED.pop(7, None)
        gemm._SM_COUNTS.pop(7, None)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            gemm.reserve_sms(7, bad, 1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="products must be an int >= 0"):
            gemm.reserve_sms(7, 24, bad)  # type: ignore[arg-type]
