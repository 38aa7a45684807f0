"""blutrain.alloc: a caching memory allocator with a native C++ core.

Blocks are carved out of segments that a provider supplies (host memory, CUDA device memory through CuPy,
pinned host memory, or a pair of C functions), kept per stream, reused best-fit, split and coalesced,
with statistics, snapshots, an event trace and pictures of both. ``blutrain.alloc.cupy.install()``
makes CuPy allocate through it.
"""

from blutrain.alloc.allocator import (
    LARGE_ROUNDING,
    LARGE_SEGMENT_SIZE,
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    SMALL_SEGMENT_SIZE,
    SMALL_SIZE,
    CachingAllocator,
)
from blutrain.alloc.errors import AllocatorError, CupyUnavailableError, InvalidPointerError, OutOfMemoryError
from blutrain.alloc.plot import plot_snapshot, plot_timeline
from blutrain.alloc.provider import ExpandableProvider, FunctionProvider, HostProvider, NativeProvider, Provider
from blutrain.alloc.snapshot import (
    BlockSnapshot,
    BlockState,
    SegmentSnapshot,
    StackFrame,
    TraceAction,
    TraceEvent,
)
from blutrain.alloc.snapshot_file import SnapshotFile, load_snapshot, save_snapshot
from blutrain.alloc.stats import AllocatorStats
from blutrain.alloc.units import format_bytes

__all__ = [
    "LARGE_ROUNDING",
    "LARGE_SEGMENT_SIZE",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "SMALL_SEGMENT_SIZE",
    "SMALL_SIZE",
    "AllocatorError",
    "AllocatorStats",
    "BlockSnapshot",
    "BlockState",
    "CachingAllocator",
    "CupyUnavailableError",
    "ExpandableProvider",
    "FunctionProvider",
    "HostProvider",
    "InvalidPointerError",
    "NativeProvider",
    "OutOfMemoryError",
    "Provider",
    "SegmentSnapshot",
    "SnapshotFile",
    "StackFrame",
    "TraceAction",
    "TraceEvent",
    "format_bytes",
    "load_snapshot",
    "plot_snapshot",
    "plot_timeline",
    "save_snapshot",
]
