"""One conformance check: run a catalogue op on a device and on the float64 reference, and compare.

The device side is the public op on tensors of the device under test, in the dtype under test and
in the sample's layouts. The reference side is the same call on contiguous CPU tensors of the
reference dtype (float64 for floating dtypes; int64, exact, for integers; bool) holding the very
values the device saw, so only the device's own arithmetic counts as error.

Floating results pass when ‖out − ref‖₂ ≤ tol · max(‖ref‖₂, √n) over the finite reference
elements: a norm-wise relative error, where outputs smaller than unit magnitude (whose rounding is
set by the O(1) inputs, not by themselves) are judged absolutely. ``tol`` is the looser of the
tested dtype's and the output dtype's: float32 1e-5, float16 1e-3, bfloat16 1e-2. NaN passes only
where the reference is NaN, ±inf only where the reference has the same infinity. Integer and bool
results must be equal, after the reference is converted to the output dtype (so integer wrap-around
is the reference's too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import blutrain.tensor as bt
from blutrain.kernels.catalogue import Arg, OpInfo, Sample, reference_dtype
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType
from blutrain.tensor.tensor import Tensor

TOLERANCE: dict[str, float] = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


class MismatchError(AssertionError):
    """A device result differs from the float64 reference by more than the dtype's tolerance."""


def _host(t: Tensor) -> np.ndarray[Any, Any]:
    return np.asarray(t.detach().cpu().numpy())


def assert_matches(out: Any, ref: Any, dtype: DType, what: str = "output") -> None:
    """Compare a device result with the reference (tensors, or tuples and lists of them)."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            raise MismatchError(f"{what}: expected {len(ref)} results, got {out!r}")
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            assert_matches(o, r, dtype, f"{what}[{i}]")
        return
    if ref is None or out is None:
        if ref is not out:
            raise MismatchError(f"{what}: expected {ref!r}, got {out!r}")
        return
    if not isinstance(out, Tensor):
        raise MismatchError(f"{what}: expected a Tensor, got {type(out).__name__}")
    if out.shape != ref.shape:
        raise MismatchError(f"{what}: shape {list(out.shape)}, the reference has {list(ref.shape)}")
    if out.dtype.is_floating != ref.dtype.is_floating or (out.dtype is bt.bool_) != (ref.dtype is bt.bool_):
        raise MismatchError(f"{what}: dtype {out.dtype.name} is of another kind than the reference's {ref.dtype.name}")
    if not out.dtype.is_floating:
        got, want = _host(out), _host(ref.to(dtype=out.dtype))
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[:5].tolist()
            raise MismatchError(f"{what}: {int((got != want).sum())} of {got.size} elements differ from the reference, "
                           f"first at {bad}: got {got[tuple(np.array(bad[0]))]!r}, expected "
                           f"{want[tuple(np.array(bad[0]))]!r}")
        return
    got, want = _host(out).astype(np.float64), _host(ref).astype(np.float64)
    tol = max(TOLERANCE[out.dtype.name], TOLERANCE.get(dtype.name, 0.0))
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    if (nan_got != nan_want).any():
        where = np.argwhere(nan_got != nan_want)[:5].tolist()
        raise MismatchError(f"{what}: NaN where the reference is not, or the reverse, at {where}")
    inf_want = np.isinf(want)
    if (np.isinf(got) != inf_want).any() or (got[inf_want] != want[inf_want]).any():
        raise MismatchError(f"{what}: infinities differ from the reference's")
    finite = np.isfinite(want)
    diff = float(np.linalg.norm(got[finite] - want[finite]))
    scale = max(float(np.linalg.norm(want[finite])), float(np.sqrt(finite.sum())))
    if diff > tol * scale:
        worst = np.unravel_index(int(np.argmax(np.where(finite, np.abs(got - want), -1.0))), want.shape)
        raise MismatchError(f"{what}: error {diff / scale:.3g} exceeds {tol:g} for {out.dtype.name} (worst element "
                       f"{list(worst)}: got {got[worst]!r}, reference {want[worst]!r})")


def _gradients(out: Any, args: list[Any], seed: int, dtype: DType) -> list[Tensor | None]:
    """Back-propagate a random gradient from the first output; the gradients of the inputs that
    require grad. Both sides draw the same values from ``seed``, rounded to the tested ``dtype``."""
    first = out[0] if isinstance(out, tuple) else out
    values = np.random.default_rng(seed).standard_normal(first.shape).astype(dtype.np)
    first.backward(bt.tensor(values, device=first.device).to(dtype=first.dtype))
    return [a.grad for a in args if isinstance(a, Tensor) and a.requires_grad]


def run_sample(op: OpInfo, dtype: DType, device: Device, sample: Sample) -> None:
    """Check ``op`` on ``device`` in ``dtype`` for one sample; raises :class:`MismatchError`."""
    ref_dtype = reference_dtype(dtype)
    cpu = bt.device("cpu")
    if op.factory:
        out = op.call(*sample.args, dtype=dtype, device=device, **sample.kwargs)
        ref = op.call(*sample.args, dtype=ref_dtype, device=cpu, **sample.kwargs)
        assert_matches(out, ref, dtype)
        return
    dev_args = [a.on(dtype, device) if isinstance(a, Arg) else a for a in sample.args]
    ref_args = [a.reference(dtype) if isinstance(a, Arg) else a for a in sample.args]
    out = op.call(*dev_args, **sample.kwargs)
    if op.reference is not None:
        as_ref = tuple(o.detach().cpu().to(dtype=ref_dtype) if isinstance(o, Tensor) else o for o in out)
        ref = op.reference(as_ref, *ref_args, **sample.kwargs)
    else:
        ref = op.call(*ref_args, **sample.kwargs)
    if op.backward:
        out = _gradients(out, dev_args, sample.grad_seed, dtype)
        ref = _gradients(ref, ref_args, sample.grad_seed, dtype)
        assert_matches(out, ref, dtype, "gradient")
        return
    assert_matches(out, ref, dtype)
