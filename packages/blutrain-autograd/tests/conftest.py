"""A second device ("host2", NumPy under another name) for the tests that move tensors between devices."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from blutrain.tensor import Device
from blutrain.tensor.testing import second_host_device


@pytest.fixture
def second_device() -> Iterator[Device]:
    with second_host_device() as device:
        yield device
