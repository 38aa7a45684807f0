"""What the kernel library's GPU tests share: a module marked ``pytestmark = pytest.mark.cuda`` is skipped
without a GPU and runs with poisoned device memory (both applied here, once, for every such module)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


@cache
def gpu_count() -> int:
    """CUDA devices CuPy sees (0 without CuPy or a driver)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and CuPy")
    for item in items:  # a conftest hook sees the whole session's items: this folder's only
        if item.get_closest_marker("cuda") is not None and item.path.is_relative_to(HERE):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poisoned_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a cuda test, fill every new device allocation with 0xFF bytes while it runs, so that a kernel reading
    memory it never wrote sees NaNs, not zeros."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    import cupy as cp

    if getattr(cp, "_blutrain_emulated", False):  # the CPU emulator's empty() poisons already
        yield
        return
    installed = cp.cuda.memory.get_allocator()  # CuPy's pool or the backend's blutrain-alloc: kept, and put back

    def alloc(size: int) -> Any:
        mem = installed(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    cp.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(installed)
