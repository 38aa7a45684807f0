"""``Backend.write_from_host``: host values copied into an existing array in place, on the CPU backend (synchronous)
and the second host device, with shape, dtype and layout mismatches refused naming both sides."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import blutrain.tensor as bt
from blutrain.tensor import PluginError, ShapeError, TensorTypeError, TensorValueError
from blutrain.tensor.backend import BackendRegistry
from blutrain.tensor.cpu.backend import NumpyBackend
from blutrain.tensor.testing import second_host_device

DTYPES = st.sampled_from([np.float64, np.float32, np.int64, np.int8, np.bool_])


@settings(max_examples=40, deadline=None)
@given(DTYPES, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0), st.data())
def test_the_cpu_backend_writes_host_values_into_the_same_array(dtype: Any, shape: tuple[int, ...],
                                                               data: st.DataObject) -> None:
    backend = bt.device("cpu").backend
    array = backend.empty(shape, bt.as_dtype(np.dtype(dtype).name), 0)
    address = backend.data_ptr(array)
    for _ in range(2):  # a first write, then other values over them
        values = data.draw(hnp.arrays(dtype, shape))
        backend.write_from_host(array, values)
        assert backend.data_ptr(array) == address  # in place: no new allocation
        np.testing.assert_array_equal(array, values)


def test_the_host_buffer_may_be_reused_as_soon_as_the_write_returns() -> None:
    backend = bt.device("cpu").backend
    array = backend.from_host(np.zeros(3), 0)
    host = np.array([1e-3, 0.1, 0.5])
    backend.write_from_host(array, host)
    host[...] = -1.0
    assert array.tolist() == [1e-3, 0.1, 0.5]


def test_the_second_host_device_writes_from_the_host_too() -> None:
    with second_host_device() as device:
        array = device.backend.from_host(np.zeros(2), device.index)
        device.backend.write_from_host(array, np.array([2.0, 3.0]))
        assert array.tolist() == [2.0, 3.0]


def test_a_host_array_of_another_shape_is_refused_naming_both() -> None:
    array = np.zeros(3)
    with pytest.raises(ShapeError, match=r"write_from_host: host has shape \(2,\), array \(3,\); give host values "
                                         r"of the array's shape"):
        bt.device("cpu").backend.write_from_host(array, np.zeros(2))
    assert array.tolist() == [0.0, 0.0, 0.0]


def test_a_host_array_of_another_dtype_is_refused_naming_both() -> None:
    with pytest.raises(TensorTypeError, match=r"write_from_host: host has dtype float32, array float64; convert the "
                                              r"host values to the array's dtype first"):
        bt.device("cpu").backend.write_from_host(np.zeros(3), np.zeros(3, np.float32))


def test_host_values_that_are_not_a_numpy_array_are_refused() -> None:
    with pytest.raises(TensorTypeError, match=r"write_from_host: host must be a numpy.ndarray, got list"):
        bt.device("cpu").backend.write_from_host(np.zeros(2), [1.0, 2.0])  # type: ignore[arg-type]


def test_a_non_contiguous_array_is_refused() -> None:
    array = np.zeros((4, 2))
    with pytest.raises(TensorValueError, match=r"write_from_host: array \(shape \(2, 2\), strides \(32, 8\)\) is not "
                                               r"C-contiguous"):
        bt.device("cpu").backend.write_from_host(array[::2], np.ones((2, 2)))
    assert not array.any()


def test_a_backend_lacking_write_from_host_is_refused_naming_it() -> None:
    class NoHostWrites(NumpyBackend):
        name = "nowrites"

        def __getattribute__(self, name: str) -> Any:
            if name == "write_from_host":
                raise AttributeError(name)
            return super().__getattribute__(name)

    with pytest.raises(PluginError, match=r"backend 'nowrites' lacks write_from_host of the"):
        BackendRegistry().register(NoHostWrites())
