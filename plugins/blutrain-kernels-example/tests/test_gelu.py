"""The example plugin: its gelu wins the registry lookup, conforms to the float64 reference, and steps aside
when blocked."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.kernels import get_op
from blutrain.kernels.conformance.suite import check_case
from blutrain.tensor.cpu.kernels import kernel_for
from blutrain_kernels_example import OP, PRIORITY, gelu_cpu, gelu_tanh_numpy

FLOATS = [bt.float16, bt.bfloat16, bt.float32, bt.float64]
IDS = [d.name for d in FLOATS]


def _cuda_available() -> bool:
    return "cuda" in bt.backends() and bt.backends().get("cuda").is_available()


def _closed_form(x: np.ndarray) -> np.ndarray:
    """The textbook tanh GELU in float64."""
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_the_plugin_kernel_wins_gelu_on_both_devices_for_every_floating_dtype(device: str, dtype: bt.DType) -> None:
    entry = bt.kernels().lookup(OP, device, dtype)
    assert entry.provider.plugin == "kernels-example"
    assert entry.priority == PRIORITY


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not _cuda_available(), reason="needs an NVIDIA GPU and CuPy")]),
])
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_the_kernel_passes_the_conformance_suite(device: str, dtype: bt.DType) -> None:
    result = check_case(get_op(OP), dtype, bt.device(device), examples=40)
    assert result.provider == "kernels-example"
    assert result.status == "passed", f"{result.message}\n{result.sample}"


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs an NVIDIA GPU and CuPy")
def test_the_cuda_kernel_agrees_with_the_cpu_kernel() -> None:
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 4
    on_gpu = bt.gelu(bt.tensor(x, device="cuda"), approximate="tanh").cpu().numpy()
    np.testing.assert_allclose(on_gpu, gelu_tanh_numpy(x), rtol=2e-6, atol=1e-7)


def test_the_tanh_form_matches_the_float64_closed_form_from_minus_to_plus_60() -> None:
    x = np.linspace(-60.0, 60.0, 100_001)
    got32 = gelu_cpu(x.astype(np.float32), "tanh")
    assert got32.dtype == np.float32 and np.isfinite(got32).all()
    np.testing.assert_allclose(got32, _closed_form(x.astype(np.float32)), rtol=2e-6, atol=1e-7)
    # absolute in the far negative tail: there the textbook form cancels (1 + tanh(u) for u ≪ 0) and is the
    # less accurate of the two, while x / (1 + e^(−2u)) keeps its relative precision
    np.testing.assert_allclose(gelu_cpu(x, "tanh"), _closed_form(x), rtol=1e-14, atol=1e-15)


def test_very_negative_inputs_give_minus_zero_without_a_warning() -> None:
    with np.errstate(all="raise"):
        out = gelu_tanh_numpy(np.array([-1e4, -100.0], dtype=np.float32))
    assert out.tolist() == [0.0, 0.0] and np.signbit(out).all()


def test_a_0d_input_gives_a_0d_array() -> None:
    out = gelu_cpu(np.array(1.5, dtype=np.float32), "tanh")
    assert isinstance(out, np.ndarray) and out.shape == ()


@pytest.mark.parametrize("dtype", [bt.float16, bt.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_is_computed_in_float32_and_rounded_once(dtype: bt.DType) -> None:
    x = (np.random.default_rng(1).standard_normal(1000) * 3).astype(dtype.np)
    expected = gelu_tanh_numpy(x.astype(np.float32)).astype(dtype.np)
    got = gelu_cpu(x, "tanh")
    assert got.dtype == dtype.np
    np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_the_erf_form_is_the_built_in_kernel_bit_for_bit(dtype: bt.DType) -> None:
    x = np.random.default_rng(2).standard_normal((7, 9)).astype(dtype.np)
    np.testing.assert_array_equal(gelu_cpu(x, "none"), kernel_for("gelu", dtype)(x, "none"))


def test_blocking_the_plugin_gives_the_built_in_kernel_back() -> None:
    probe = "import blutrain.tensor as bt; print(bt.kernels().lookup('gelu', 'cpu', bt.float32).provider.plugin)"
    env = {**os.environ, "BLUTRAIN_DISABLE_PLUGINS": "kernels-example"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "cpu-kernels"
