"""GPU memory of the "cuda" device: blutrain-alloc's caching allocator is what CuPy uses by default, and
its numbers and snapshots are reachable through ``blutrain_backend_cupy.cuda``. Skipped without a GPU
(the setting itself is checked without one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import blutrain.tensor as bt
from blutrain_backend_cupy import cuda, memory

MiB = 1 << 20


def test_an_unknown_allocator_setting_is_refused_naming_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.ALLOCATOR_ENV, "jemalloc")
    with pytest.raises(memory.CudaAllocatorError, match="expected one of blutrain, cupy, got 'jemalloc'"):
        memory.allocator_name()
    monkeypatch.setenv(memory.ALLOCATOR_ENV, "CuPy ")
    assert memory.allocator_name() == "cupy"


@pytest.mark.cuda
@pytest.mark.skipif(not cuda.is_available(), reason="needs an NVIDIA GPU and CuPy")
def test_tensors_allocate_through_blutrain_alloc_with_peaks_and_a_snapshot(tmp_path: Path) -> None:
    if os.environ.get(memory.ALLOCATOR_ENV, "blutrain") == "cupy":
        pytest.skip("BLUTRAIN_CUDA_ALLOCATOR=cupy chosen for this run")
    bt.zeros(1, device="cuda")
    assert cuda.allocator_name() == "blutrain"
    import cupy

    assert type(cupy.cuda.memory.get_allocator()).__name__ == "CupyAllocator"
    cuda.synchronize()
    cuda.reset_peak_memory_stats()
    base = cuda.memory_allocated()
    cuda.record_memory_history(True, trace_capacity=1000, stacks=True)
    x = bt.empty(8 * MiB // 4, device="cuda")  # 8 MiB of float32
    assert cuda.memory_allocated() >= base + 8 * MiB
    assert cuda.max_memory_allocated() >= base + 8 * MiB
    assert cuda.memory_reserved() >= cuda.memory_allocated()
    path = cuda.save_memory_snapshot(tmp_path / "snap.json")
    del x
    assert cuda.memory_allocated() == base
    assert cuda.max_memory_allocated() >= base + 8 * MiB
    cuda.record_memory_history(False)
    from blutrain.alloc import load_snapshot

    loaded = load_snapshot(path)
    assert any(e.size >= 8 * MiB for e in loaded.trace)
    assert any(b.stack for s in loaded.segments for b in s.blocks)
    cuda.empty_cache()
    assert cuda.memory_reserved() <= cuda.max_memory_reserved()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda.is_available(), reason="needs an NVIDIA GPU and CuPy")
def test_running_out_of_device_memory_raises_the_allocators_report() -> None:
    if os.environ.get(memory.ALLOCATOR_ENV, "blutrain") == "cupy":
        pytest.skip("BLUTRAIN_CUDA_ALLOCATOR=cupy chosen for this run")
    from blutrain.alloc import OutOfMemoryError

    with pytest.raises(OutOfMemoryError, match=r"tried to allocate 256\.00 TiB .* free of .* allocated .* reserved"):
        bt.empty(1 << 48, dtype="uint8", device="cuda")  # 256 TiB
