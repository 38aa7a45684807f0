"""Every op of the catalogue, in every dtype it supports, agrees with the float64 reference.

Run against any installed device: ``pytest --pyargs blutrain.kernels.conformance --blutrain-device=NAME``
(the option and the ``blutrain_device`` fixture come from the ``blutrain-conformance`` pytest plugin).
Inputs are hypothesis-drawn; a failure prints the shrunk sample and how to reproduce it.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings

from blutrain.kernels.catalogue import CATALOGUE, OpInfo, Sample
from blutrain.kernels.conformance.check import run_sample
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType

# Modest on purpose: the suite runs in every `uv run pytest`; each (op, dtype) draws anew per run.
EXAMPLES = 8
CASES = [pytest.param(op, dtype, id=f"{op.name}-{dtype.name}") for op in CATALOGUE.values() for dtype in op.dtypes]
# backward kernels are reached through Tensor.backward, which needs the blutrain-autograd package
HAS_AUTOGRAD = importlib.util.find_spec("blutrain.autograd") is not None


@pytest.mark.parametrize(("op", "dtype"), CASES)
def test_op_matches_float64_reference(op: OpInfo, dtype: DType, blutrain_device: Device) -> None:
    if (op.backward or op.reference is not None) and not HAS_AUTOGRAD:
        pytest.skip("backward kernels are reached through Tensor.backward: pip install blutrain-autograd")

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(sample=op.samples(dtype))
    def check(sample: Sample) -> None:
        run_sample(op, dtype, blutrain_device, sample)

    check()
