"""pytest plugin (entry point ``pytest11``): the ``group_of_one`` fixture, for the tests of parallel modes and of
communication code that run in a single process.

It is loaded into every pytest run of an environment where blutrain-dist is installed, so it does nothing more than
declare the fixture; the group is made only when a test asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from blutrain.dist.process_group import ProcessGroup


@pytest.fixture(scope="module")
def group_of_one() -> Iterator[ProcessGroup]:
    """This process alone as a process group (rank 0 of 1) of the communication backend the host device declares
    (``default_comm_backend("cpu")``: it needs no launcher and no GPU), destroyed after the test module; skips the
    test where that backend is not installed."""
    from blutrain.dist.group import default_comm_backend
    from blutrain.dist.registry import comm_backends

    name, backends = default_comm_backend("cpu"), comm_backends()
    if name not in backends:
        pytest.skip(f"needs the host's communication backend {name!r}, which is not installed")
    group: ProcessGroup = backends.get(name)(rank=0, world_size=1, store=None, timeout=30.0)
    try:
        yield group
    finally:
        group.destroy()
