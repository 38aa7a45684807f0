"""Conversions (NumPy, DLPack, Python values, devices) and seeded random numbers."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import AutogradError, Tensor, TensorTypeError


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                                   "float64"])
def test_dlpack_round_trip_with_numpy_shares_memory(dtype: str) -> None:
    x = bt.arange(6).reshape(2, 3).to(dtype=dtype)
    exported = np.from_dlpack(x)
    assert np.shares_memory(exported, x.numpy())
    back = bt.from_dlpack(exported)
    assert back.dtype is x.dtype and back.shape == (2, 3) and back.device.type == "cpu"
    assert back.data_ptr() == x.data_ptr()
    back.fill_(True if dtype == "bool" else 1)
    assert bool((x == back).all()) and x.tolist()[0][0] == (True if dtype == "bool" else 1)


def test_dlpack_import_of_a_numpy_array_sees_later_writes() -> None:
    a = np.zeros(3, dtype=np.float32)
    t = bt.from_dlpack(a)
    a[1] = 5
    assert t.tolist() == [0.0, 5.0, 0.0]


def test_dlpack_export_of_a_non_contiguous_view_keeps_its_strides() -> None:
    x = bt.arange(12, dtype="float32").reshape(3, 4)[:, ::2]
    exported = np.from_dlpack(x)
    np.testing.assert_array_equal(exported, x.numpy())
    assert np.shares_memory(exported, x.numpy())


def test_dlpack_export_of_bfloat16_is_refused_with_a_way_out() -> None:
    with pytest.raises(TensorTypeError, match=r"__dlpack__: a bfloat16 tensor on cpu cannot be exported.*\.float\(\)"):
        np.from_dlpack(bt.ones(2, dtype="bfloat16"))


def test_dlpack_export_of_a_tensor_that_requires_grad_needs_detach() -> None:
    x = bt.ones(2, requires_grad=True)
    with pytest.raises(AutogradError, match="detach"):
        x.__dlpack__()
    assert np.from_dlpack(x.detach()).tolist() == [1.0, 1.0]


def test_from_numpy_and_numpy_share_memory() -> None:
    a = np.arange(4.0)
    t = bt.from_numpy(a)
    t.add_(1)
    np.testing.assert_array_equal(a, [1, 2, 3, 4])
    assert t.numpy() is not None and np.shares_memory(t.numpy(), a)


def test_tensor_copies_its_input() -> None:
    a = np.arange(3.0)
    t = bt.tensor(a)
    a[0] = 9
    assert t.tolist() == [0.0, 1.0, 2.0]
    assert t.dtype is bt.float64


def test_tensor_from_python_values_uses_pytorch_default_dtypes() -> None:
    assert bt.tensor(1.5).shape == () and bt.tensor(1.5).dtype is bt.float32
    assert bt.tensor([1, 2]).dtype is bt.int64
    assert bt.tensor([True]).dtype is bt.bool_
    assert bt.tensor([[1.0, 2.0]]).tolist() == [[1.0, 2.0]]


def test_item_and_python_conversions() -> None:
    assert bt.tensor([2.5]).item() == 2.5 and isinstance(bt.tensor(3).item(), int)
    assert float(bt.tensor(2.5)) == 2.5 and int(bt.tensor(7)) == 7 and bool(bt.tensor(True))
    assert [0, 1, 2][bt.tensor(2)] == 2


def test_to_changes_dtype_and_device_and_is_a_no_op_otherwise(second_device: bt.Device) -> None:
    x = bt.tensor([1.5, -2.5])
    assert x.to("float32") is x and x.to("cpu") is x
    y = x.to(second_device, "float64")
    assert y.device is second_device and y.dtype is bt.float64
    assert y.to("cpu").tolist() == [1.5, -2.5]
    assert x.to(dtype="int32").tolist() == [1, -2]
    assert x.to(y).dtype is bt.float64


def test_manual_seed_makes_every_random_factory_reproducible() -> None:
    def draw() -> list[Tensor]:
        bt.manual_seed(1234)
        return [bt.rand(3, 4), bt.randn(5), bt.randint(0, 10, (6,)), bt.dropout(bt.ones(8), 0.5),
                bt.randn(2, dtype="bfloat16"), bt.empty(3).normal_(), bt.empty(3).uniform_(-1, 1)]

    first, second = draw(), draw()
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    bt.manual_seed(1235)
    assert not np.array_equal(bt.rand(3, 4).numpy(), first[0].numpy())


def test_random_factories_draw_from_the_right_distributions() -> None:
    bt.manual_seed(0)
    u, n = bt.rand(20000).numpy(), bt.randn(20000).numpy()
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
    r = bt.randint(3, 7, (1000,)).numpy()
    assert set(np.unique(r)) == {3, 4, 5, 6}


def test_a_generator_state_restores_the_stream_exactly() -> None:
    gen = bt.device("cpu").backend.generator(0)
    state = gen.get_state()
    first = bt.randn(4).numpy()
    gen.set_state(state)
    np.testing.assert_array_equal(bt.randn(4).numpy(), first)


def test_the_seed_survives_plugins_being_reloaded() -> None:
    bt.manual_seed(99)
    expected = bt.randn(3).numpy()
    bt.manual_seed(99)
    from blutrain.tensor import plugins

    plugins.reload()
    np.testing.assert_array_equal(bt.randn(3).numpy(), expected)


def test_tensors_made_before_and_after_a_plugin_change_still_meet() -> None:
    before = bt.ones(2)
    from blutrain.tensor import plugins

    plugins.reload()
    assert (before + bt.ones(2)).tolist() == [2.0, 2.0]
