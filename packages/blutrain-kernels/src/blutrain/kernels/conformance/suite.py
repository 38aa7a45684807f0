"""The conformance suite as a function, for ``blutrain plugins --check`` and for scripts.

:func:`check_device` runs every catalogue op in every dtype it supports on one device, each against the
float64 reference, with hypothesis drawing the inputs exactly as the pytest suite
(``pytest --pyargs blutrain.kernels.conformance``) does, and yields one :class:`CaseResult` per
(op, dtype): passed, failed (with the message and the failing sample) or skipped (with the reason).
Needs hypothesis (``pip install 'blutrain-kernels[conformance]'``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from blutrain.kernels.catalogue import CATALOGUE, OpInfo, Sample, get_op
from blutrain.kernels.conformance.check import run_sample
from blutrain.tensor.device import Device
from blutrain.tensor.dtype import DType
from blutrain.tensor.errors import KernelNotFoundError
from blutrain.tensor.kernel import kernels

DEFAULT_EXAMPLES = 8
# backward kernels are reached through Tensor.backward, which needs the blutrain-autograd package
HAS_AUTOGRAD = importlib.util.find_spec("blutrain.autograd") is not None


@dataclass(frozen=True)
class CaseResult:
    """The verdict for one (op, dtype) on one device. ``provider`` is the plugin whose kernel ran."""

    op: str
    dtype: str
    device: str
    provider: str
    status: str  # "passed", "failed" or "skipped"
    message: str = ""  # why it failed or was skipped
    sample: str = ""  # the failing sample, as hypothesis drew it

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def provider_of(op: str, device: Device, dtype: DType) -> str:
    """The plugin whose kernel wins for (op, device type, dtype), or "-" where none is registered."""
    try:
        return kernels().lookup(op, device.type, dtype).provider.plugin
    except KernelNotFoundError:
        return "-"


def check_case(op: OpInfo, dtype: DType, device: Device, examples: int = DEFAULT_EXAMPLES) -> CaseResult:
    """Run ``examples`` hypothesis-drawn samples of ``op`` in ``dtype`` on ``device``."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings

    provider = provider_of(op.name, device, dtype)
    if (op.backward or op.reference is not None) and not HAS_AUTOGRAD:
        return CaseResult(op.name, dtype.name, str(device), provider, "skipped",
                          "backward kernels are reached through Tensor.backward: pip install blutrain-autograd")
    failing: list[Sample] = []

    # No shrinking: a failure is reported with the sample that first failed, in seconds rather than the
    # minutes a shrink of a large sample can take; the pytest suite shrinks.
    @settings(max_examples=examples, deadline=None, database=None, print_blob=False, verbosity=Verbosity.quiet,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(sample=op.samples(dtype))
    def run(sample: Sample) -> None:
        try:
            run_sample(op, dtype, device, sample)
        except Exception:
            failing.append(sample)
            raise

    try:
        run()
    except Exception as exc:  # any exception is the kernel's failure to conform, reported, not raised
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        return CaseResult(op.name, dtype.name, str(device), provider, "failed", message,
                          repr(failing[-1]) if failing else "")
    return CaseResult(op.name, dtype.name, str(device), provider, "passed")


def check_device(device: Device, ops: Iterable[str] | None = None,
                 examples: int = DEFAULT_EXAMPLES) -> Iterator[CaseResult]:
    """Every (op, dtype) of the catalogue (or of ``ops``, catalogue names) on ``device``, in catalogue order."""
    chosen = [get_op(name) for name in ops] if ops is not None else list(CATALOGUE.values())
    for op in chosen:
        for dtype in op.dtypes:
            yield check_case(op, dtype, device, examples)


__all__ = ["DEFAULT_EXAMPLES", "CaseResult", "check_case", "check_device", "provider_of"]
