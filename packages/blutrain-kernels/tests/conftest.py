"""Fixtures of the kernel library's GPU tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def poisoned_memory() -> Iterator[None]:
    """Fill every new device allocation with 0xFF bytes while a test runs, so that a kernel reading memory it
    never wrote sees NaNs, not zeros (the GPU test modules use it through ``pytest.mark.usefixtures``)."""
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
