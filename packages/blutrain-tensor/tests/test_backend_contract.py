"""The Backend protocol's declared members beyond arrays and copies (TF32, deterministic kernels, erf): the CPU
backend's TF32 answer, erf taken from the backend that owns an array, and a backend lacking a member refused."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import PluginError
from blutrain.tensor.backend import BackendRegistry, array_backend
from blutrain.tensor.cpu.backend import NumpyBackend


def test_the_cpu_has_no_tf32_mode() -> None:
    backend = bt.device("cpu").backend
    assert backend.set_tf32(True) is False
    assert backend.set_tf32(False) is False


def test_a_numpy_array_and_a_numpy_scalar_belong_to_a_numpy_backend() -> None:
    assert isinstance(array_backend(np.zeros(2)), NumpyBackend)
    assert isinstance(array_backend(np.float32(0.5)), NumpyBackend)  # 0-d arithmetic gives NumPy scalars


def test_erf_and_exact_gelu_of_a_0d_tensor_match_math_erf() -> None:
    x = bt.tensor(0.5, dtype=bt.float64)
    assert bt.erf(x).item() == math.erf(0.5)
    np.testing.assert_allclose(bt.gelu(x).item(), 0.25 * (1 + math.erf(0.5 / math.sqrt(2))), rtol=1e-15)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-6.0, 6.0), min_size=1, max_size=16), st.sampled_from(["float32", "float64"]))
def test_erf_is_the_owning_backends_and_matches_math_erf(values: list[float], dtype: str) -> None:
    x = np.asarray(values, dtype=dtype)
    got = array_backend(x).erf(x)
    assert got.dtype == x.dtype
    reference = np.asarray([math.erf(v) for v in x.astype(np.float64)])
    np.testing.assert_allclose(got.astype(np.float64), reference, rtol=1e-6 if dtype == "float32" else 1e-15,
                               atol=1e-7 if dtype == "float32" else 0.0)
    np.testing.assert_allclose(bt.erf(bt.tensor(x)).numpy(), got, rtol=0, atol=0)  # the op's kernel asks the same


class _NoErf:
    name = "noerf"
    xp = np
    array_type = type("NoErfArray", (), {})
    dlpack_device_type = 1

    def __getattr__(self, name: str) -> Any:
        if name in ("erf", "set_tf32", "set_deterministic"):
            raise AttributeError(name)
        return lambda *args: None


def test_a_backend_lacking_a_declared_member_is_refused_naming_it() -> None:
    registry = BackendRegistry()
    with pytest.raises(PluginError, match=r"backend 'noerf' lacks set_tf32, set_deterministic, erf of the "
                                          r"blutrain.tensor.Backend protocol"):
        registry.register(_NoErf())  # type: ignore[arg-type]


def test_the_default_device_is_the_first_available_accelerator_else_the_host() -> None:
    """The CPU backend declares itself no accelerator; where no accelerator backend is available (this machine has no
    GPU, or the CUDA backend is not installed) ``--device auto`` is the host."""
    registry = bt.backends()
    cpu = registry.get("cpu")
    assert cpu.accelerator is False and cpu.comm_backend == "mpi"
    accelerators = [n for n in registry.names() if registry.get(n).accelerator and registry.get(n).is_available()]
    assert bt.default_device() == (accelerators[0] if accelerators else "cpu")


def test_a_backend_lacking_the_device_declarations_is_refused_naming_them() -> None:
    class NoDeclarations(NumpyBackend):
        name = "nodecl"

        def __getattribute__(self, name: str) -> Any:
            if name in ("accelerator", "comm_backend"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    with pytest.raises(PluginError, match=r"backend 'nodecl' lacks accelerator, comm_backend of the"):
        BackendRegistry().register(NoDeclarations())  # type: ignore[arg-type]
