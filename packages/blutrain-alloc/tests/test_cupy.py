"""The CuPy hook-up: importable without CuPy, a clear error without it, and real use on a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import blutrain.alloc.cupy as alloc_cupy
from blutrain.alloc import BlockState, CachingAllocator, CupyUnavailableError


def cuda_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


HAS_CUDA = cuda_available()
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and an NVIDIA GPU")


def test_importing_the_package_and_the_cupy_module_needs_no_cupy() -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # makes `import cupy` fail as if it were not installed
        "import blutrain.alloc, blutrain.alloc.cupy as c\n"
        "try:\n    c.install()\nexcept blutrain.alloc.CupyUnavailableError as e:\n    print('ERR', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("ERR blutrain.alloc.cupy needs CuPy")
    assert "blutrain-alloc[cuda12]" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_install_without_cupy_raises_an_import_error_that_says_how_to_get_it() -> None:
    with pytest.raises(CupyUnavailableError, match="pip install 'blutrain-alloc\\[cuda12\\]'") as info:
        alloc_cupy.install()
    assert isinstance(info.value, ImportError)


@cuda
@needs_gpu
def test_cupy_arrays_allocate_from_the_caching_allocator_and_free_on_deletion() -> None:
    import cupy

    hook = alloc_cupy.install()
    try:
        x = cupy.arange(1000, dtype=cupy.float32)
        y = x * 2
        assert float(y.sum()) == pytest.approx(999000.0)
        allocator = hook.allocator()
        addresses = {
            b.address
            for s in allocator.memory_snapshot()
            for b in s.blocks
            if b.state is BlockState.ALLOCATED
        }
        assert x.data.ptr in addresses and y.data.ptr in addresses
        before = allocator.stats().allocation_count
        ptr = y.data.ptr
        del y
        assert allocator.stats().allocation_count == before - 1
        z = cupy.empty(1000, dtype=cupy.float32)
        assert z.data.ptr == ptr  # the freed block comes back on the same stream
        del x, z
        hook.empty_cache()
        assert allocator.stats().reserved_bytes == 0
    finally:
        alloc_cupy.uninstall()


@cuda
@needs_gpu
def test_an_array_used_on_another_stream_is_reused_only_after_that_stream_finishes() -> None:
    import cupy

    hook = alloc_cupy.install()
    try:
        side = cupy.cuda.Stream(non_blocking=True)
        x = cupy.ones(1 << 20, dtype=cupy.float32)
        with side:
            cupy.cuda.runtime.memsetAsync(x.data.ptr, 0, x.nbytes, side.ptr)
        hook.record_stream(x, side)
        ptr = x.data.ptr
        del x
        side.synchronize()
        y = cupy.empty(1 << 20, dtype=cupy.float32)
        assert y.data.ptr == ptr
        assert hook.allocator().stats().pending_bytes == 0
    finally:
        alloc_cupy.uninstall()


@cuda
@needs_gpu
def test_out_of_device_memory_raises_out_of_memory_error_with_the_device_numbers() -> None:
    import cupy

    from blutrain.alloc import OutOfMemoryError

    hook = alloc_cupy.install()
    try:
        _free, total = cupy.cuda.runtime.memGetInfo()
        with pytest.raises(OutOfMemoryError) as info:
            cupy.empty(total * 2, dtype=cupy.uint8)
        assert info.value.provider_total == total
        assert hook.allocator().stats().oom_count == 1
    finally:
        alloc_cupy.uninstall()


@cuda
@needs_gpu
def test_pinned_host_memory_comes_from_a_caching_allocator() -> None:
    import cupy
    import numpy

    pinned = alloc_cupy.install_pinned()
    try:
        x = cupy.arange(4096, dtype=cupy.float64)
        host = cupy.cuda.alloc_pinned_memory(x.nbytes)
        out = numpy.frombuffer(host, dtype=numpy.float64, count=4096)
        x.get(out=out)
        assert out[4095] == 4095.0
        assert pinned.allocator.stats().allocation_count == 1
        del out, host
        assert pinned.allocator.stats().allocation_count == 0
    finally:
        alloc_cupy.uninstall_pinned()


@cuda
@needs_gpu
def test_expandable_segments_grow_one_range_of_cuda_virtual_memory_in_place() -> None:
    import cupy

    provider = alloc_cupy.CupyDeviceProvider()
    allocator = CachingAllocator(provider, expandable_segments=True)
    granularity = provider.granularity()
    assert granularity % 512 == 0
    sizes = [3 << 20, 5 << 20, 100 << 20]
    ptrs = [allocator.malloc(size) for size in sizes]
    assert ptrs[1] == ptrs[0] + sizes[0] and ptrs[2] == ptrs[1] + sizes[1]
    (segment,) = allocator.memory_snapshot()
    assert segment.expandable and segment.size == allocator.stats().reserved_bytes
    for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):  # the memory is there, readable and writable
        memory = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, None, provider.device_id), 0)
        array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=memory)
        array.fill(i + 1)
        assert bool((array == i + 1).all())
        del array, memory
    cupy.cuda.runtime.deviceSynchronize()
    allocator.free(ptrs[2])
    allocator.empty_cache()
    kept = -(-(8 << 20) // granularity) * granularity  # the 100 MiB at the end went back to the driver
    assert allocator.stats().reserved_bytes == kept
    for ptr in ptrs[:2]:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.stats().reserved_bytes == 0
    assert provider._virtual is not None and provider._virtual.mapped_bytes == 0


@cuda
@needs_gpu
def test_blutrain_alloc_conf_makes_install_use_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    import cupy

    from blutrain.alloc import OutOfMemoryError

    monkeypatch.setenv(alloc_cupy.CONF_VARIABLE, "expandable_segments:True")
    hook = alloc_cupy.install()
    try:
        assert hook.expandable_segments
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        y = cupy.ones((2048, 2048), dtype=cupy.float32) @ cupy.ones((2048, 2048), dtype=cupy.float32)
        assert float(y[0, 0]) == 2048.0 and float(x[-1]) == float((1 << 20) - 1)
        allocator = hook.allocator()
        assert allocator.expandable_segments
        assert all(s.expandable for s in allocator.memory_snapshot())
        _free, total = cupy.cuda.runtime.memGetInfo()
        with pytest.raises(OutOfMemoryError) as info:
            cupy.empty(total * 2, dtype=cupy.uint8)
        assert info.value.provider_total == total
        del x, y
        hook.empty_cache()
        assert allocator.stats().reserved_bytes == 0
    finally:
        alloc_cupy.uninstall()
