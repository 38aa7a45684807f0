"""The CPU backend's C-allocator setting (blutrain.tensor.cpu.host_memory): glibc keeps freed host memory for
reuse unless BLUTRAIN_CPU_MALLOC=system; an unknown value is refused in one line."""

from __future__ import annotations

import platform

import pytest

from blutrain.tensor.cpu import host_memory
from blutrain.tensor.errors import TensorValueError


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(host_memory, "_applied", None)  # as in a new process
    return monkeypatch


def test_glibc_keeps_freed_memory_by_default(fresh: pytest.MonkeyPatch) -> None:
    fresh.delenv("BLUTRAIN_CPU_MALLOC", raising=False)
    want = "kept" if platform.libc_ver()[0] == "glibc" else "unavailable"
    assert host_memory.keep_freed_memory() == want
    assert host_memory.keep_freed_memory() == want  # once per process


def test_system_leaves_the_allocator_alone(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("BLUTRAIN_CPU_MALLOC", "system")
    assert host_memory.keep_freed_memory() == "system"


def test_an_unknown_choice_is_refused_naming_both(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("BLUTRAIN_CPU_MALLOC", "jemalloc")
    with pytest.raises(TensorValueError, match="BLUTRAIN_CPU_MALLOC must be one of keep, system, got 'jemalloc'"):
        host_memory.keep_freed_memory()
