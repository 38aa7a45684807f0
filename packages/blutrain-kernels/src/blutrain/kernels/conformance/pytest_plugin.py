"""pytest plugin (entry point ``pytest11``): the ``--blutrain-device`` option and its fixture.

It is loaded into every pytest run of an environment where blutrain-kernels is installed, so it
does nothing more than declare the option; the device is resolved only when a test asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from blutrain.tensor.device import Device

OPTION = "--blutrain-device"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("blutrain", "BluTrain kernel conformance")
    group.addoption(OPTION, action="store", default="cpu", metavar="DEVICE",
                    help="device whose kernels the conformance suite checks (default: cpu)")


@pytest.fixture(scope="session")
def blutrain_device(request: pytest.FixtureRequest) -> Device:
    """The device named by ``--blutrain-device``; skips the test when its backend has no device."""
    from blutrain.tensor.device import device

    name = str(request.config.getoption(OPTION))
    dev = device(name)
    if not dev.backend.is_available():
        pytest.skip(f"device {name!r} is installed but not available on this machine")
    return dev
