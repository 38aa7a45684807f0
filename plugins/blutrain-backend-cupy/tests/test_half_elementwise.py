"""The "cuda" device's bfloat16/float16 elementwise ops: the kernel library's one-launch kernels registered above
the generic path (widen, float32 CuPy op, narrow) for the calls they cover, which they compute bit for bit as it
does, and the generic path for the rest (strided views, other broadcasts). The registration is checked on any
machine; the kernels on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.kernels import cuda as fused
from blutrain.tensor.kernel import KernelRegistry
from blutrain_backend_cupy import cuda, kernels

needs_gpu = pytest.mark.skipif(not cuda.is_available(), reason="needs an NVIDIA GPU and CuPy")
HALF_OPS = sorted(op for op, (_, names) in fused.KERNELS.items() if names == ("bfloat16", "float16"))
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "pow", "eq", "ne", "lt", "le", "gt", "ge")


def test_the_half_precision_elementwise_ops_have_one_launch_kernels() -> None:
    assert set(BINARY) | {"neg", "abs", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "tanh", "sin", "cos",
                          "relu"} == set(HALF_OPS)


@pytest.mark.parametrize("op", HALF_OPS)
def test_the_one_launch_kernels_win_for_bfloat16_and_float16_only(op: str) -> None:
    registry = KernelRegistry()
    kernels.register(registry, True)  # as on a machine with a GPU (registration itself runs no device code)
    launcher = fused.KERNELS[op][0]
    for dtype in (bt.bfloat16, bt.float16):
        found = registry.lookup(op, "cuda", dtype)
        assert found.priority == kernels.FUSED_PRIORITY
        assert found.fn.__doc__ == launcher.__doc__  # the launcher, with the generic kernel as its fallback
    found = registry.lookup(op, "cuda", bt.float32)
    assert found.priority == 0 and found.fn.__doc__ != launcher.__doc__


def test_half_precision_ops_without_a_one_launch_kernel_keep_the_generic_path() -> None:
    registry = KernelRegistry()
    kernels.register(registry, True)
    for op in ("floor_divide", "remainder", "sign", "sigmoid", "clamp"):
        assert registry.lookup(op, "cuda", bt.bfloat16).priority == 0, op


# ------------------------------------------------------------------------------------------- on a GPU


def _bits(t: bt.Tensor) -> np.ndarray[Any, Any]:
    a = np.asarray(t.cpu().numpy())
    return a.view(np.uint8) if a.dtype == np.bool_ else a.view(np.uint16)


Case = Callable[[bt.Tensor, bt.Tensor, bt.Tensor, bt.Tensor], bt.Tensor]
# (x, y, row, col): x and y (4, 6, 32), row (32,), col (4, 6, 1)
CASES: dict[str, Case] = {
    "add": lambda x, y, row, col: x + y,
    "add_row": lambda x, y, row, col: x + row,
    "row_sub": lambda x, y, row, col: row - x,
    "mul_column": lambda x, y, row, col: x * col,
    "div_scalar": lambda x, y, row, col: x / 3.0,
    "scalar_sub": lambda x, y, row, col: 1 - x,
    "maximum": lambda x, y, row, col: bt.maximum(x, y),
    "gt_scalar": lambda x, y, row, col: x > 0,
    "le_row": lambda x, y, row, col: row <= x,
    "neg": lambda x, y, row, col: -x,
    "sqrt_abs": lambda x, y, row, col: bt.sqrt(bt.abs(x)),
    "square": lambda x, y, row, col: x**2,
    "relu": lambda x, y, row, col: bt.relu(x),
    "strided_add": lambda x, y, row, col: x[:, ::2] + y[:, ::2],       # the generic path
    "transposed_mul": lambda x, y, row, col: x.transpose(0, 2) * y.transpose(0, 2),
    "middle_broadcast": lambda x, y, row, col: x + y[:, :1],          # (4, 6, 32) + (4, 1, 32): generic
}


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_half_precision_ops_on_cuda_equal_the_cpu_bit_for_bit(dtype: str, name: str) -> None:
    """Normal values (no subnormal operands or results, where the device flushes and the CPU does not): the exact
    ops give the CPU's bits, through the one-launch kernels or the generic path."""
    r = np.random.default_rng(8)
    host = {"x": r.standard_normal((4, 6, 32)), "y": r.standard_normal((4, 6, 32)), "row": r.standard_normal(32),
            "col": r.standard_normal((4, 6, 1))}
    cpu = {k: bt.tensor(v.astype(np.float32)).to(dtype=dtype) for k, v in host.items()}
    dev = {k: t.to(device="cuda") for k, t in cpu.items()}
    want = CASES[name](cpu["x"], cpu["y"], cpu["row"], cpu["col"])
    got = CASES[name](dev["x"], dev["y"], dev["row"], dev["col"])
    assert got.device.type == "cuda" and got.dtype is want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", BINARY)
def test_the_registered_kernel_equals_the_generic_kernel_bit_for_bit_covered_or_not(dtype: str, op: str) -> None:
    """Random bit patterns (NaNs, infinities, subnormals): contiguous and broadcast operands through the one-launch
    kernel, a strided view through the generic kernel; the registered kernel gives the generic kernel's bits."""
    import cupy as cp

    from blutrain.tensor import dispatch

    dt = bt.as_dtype(dtype)
    r = np.random.default_rng(9)
    x, y = (cp.asarray(r.integers(0, 1 << 16, (8, 40), dtype=np.uint32).astype(np.uint16).view(dt.np))
            for _ in range(2))
    registered, generic = dispatch.kernel(op, "cuda", dt), kernels.generic_kernel(op, dt)
    launcher = fused.KERNELS[op][0]
    for a, b, covered in ((x, y, True), (x, y[0], True), (x, 0.5, True), (2, y, True),
                          (x[:, ::2], y[:, ::2], False), (x.T, y.T, False)):
        assert (launcher(a, b) is not None) == covered
        got, want = registered(a, b), generic(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        view = np.uint8 if want.dtype == np.bool_ else np.uint16
        np.testing.assert_array_equal(cp.asnumpy(got).view(view), cp.asnumpy(want).view(view))
