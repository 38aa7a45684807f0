"""The catalogue documents exactly the kernels a device implements, and is usable without hypothesis."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings

from blutrain.kernels import CATALOGUE, OpInfo, get_op
from blutrain.kernels.catalogue import Arg, Sample
from blutrain.tensor.cpu import TABLE


def test_the_catalogue_has_every_built_in_kernel_op_and_nothing_else() -> None:
    assert sorted(CATALOGUE) == sorted(TABLE)


@pytest.mark.parametrize("op", CATALOGUE.values(), ids=CATALOGUE.keys())
def test_each_op_declares_the_dtypes_the_cpu_kernels_support(op: OpInfo) -> None:
    _, dtypes, _ = TABLE[op.name]
    assert sorted(d.name for d in op.dtypes) == sorted(d.name for d in dtypes)


@pytest.mark.parametrize("op", CATALOGUE.values(), ids=CATALOGUE.keys())
def test_each_op_has_a_signature_and_a_one_line_meaning(op: OpInfo) -> None:
    assert op.signature and "\n" not in op.signature
    assert op.meaning and "\n" not in op.meaning and len(op.meaning) < 110


@pytest.mark.parametrize("op", CATALOGUE.values(), ids=CATALOGUE.keys())
def test_each_op_draws_samples_for_each_of_its_dtypes(op: OpInfo) -> None:
    for dtype in op.dtypes:
        @settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(sample=op.samples(dtype))
        def check(sample: Sample) -> None:
            assert isinstance(sample, Sample)
            if not op.factory:
                assert any(isinstance(a, Arg) for a in sample.args)
            if op.backward:
                assert any(isinstance(a, Arg) and a.grad for a in sample.args)

        check()


def test_get_op_of_an_unknown_name_lists_the_known_ones() -> None:
    assert get_op("add").name == "add"
    with pytest.raises(KeyError, match="no op 'addd' in the catalogue; known: abs, add"):
        get_op("addd")


def test_importing_the_catalogue_does_not_import_hypothesis() -> None:
    code = ("import sys, blutrain.kernels; import blutrain.kernels.catalogue; "
            "print('hypothesis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
