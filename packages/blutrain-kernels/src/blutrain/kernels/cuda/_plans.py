"""Device tables of the multi-tensor kernels (AdamW, scale, casts) and the memory that captured CUDA graphs
read: plans cached per set of buffers, device memory outside every pool, host tables uploaded outside a
capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    _cp,
)


def _cached_plan(key: tuple[Any, ...], cacheable: bool, build: Callable[[bool], Any], plans: dict[Any, Any],
                 graph_plans: dict[Any, Any]) -> Any:
    """The launch plan (device tables) of a multi-tensor kernel for ``key`` (its buffers' pointers, sizes,
    dtypes): cached, built by ``build(capturing)`` on a miss. A plan built or used while the current stream
    captures a CUDA graph is kept for good in ``graph_plans`` (the graph reads its tables at every replay);
    others are evicted past 16. ``cacheable`` False (a plan over temporary copies): built every call."""
    plan = (graph_plans.get(key) or plans.get(key)) if cacheable else None
    if plan is not None and key in graph_plans:
        return plan
    capturing = bool(_cp().cuda.get_current_stream().is_capturing())
    if plan is None:
        plan = build(capturing)
        if capturing:
            graph_plans[key] = plan
        elif cacheable:
            if len(plans) >= 16:
                plans.clear()
            plans[key] = plan
    elif capturing:  # an eager plan a graph now reads: out of reach of the eviction
        graph_plans[key] = plan
    return plan


def _unpooled(shape: tuple[int, ...], dtype: Any) -> Array:
    """An uninitialised array in device memory of its own (cudaMalloc), outside every pool: freed when the
    last reference goes, never handed to another request while a captured graph may still read it."""
    cp = _cp()
    nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(cp.cuda.Memory(nbytes), 0))


def _upload(host: np.ndarray[Any, Any], capturing: bool) -> Array:
    """``host`` copied to the device. While the current stream captures a CUDA graph, the copy runs on a
    side stream and is waited for here, into memory allocated outside any pool: a captured copy would
    re-read CuPy's pinned staging buffer at every replay, long after it was recycled."""
    cp = _cp()
    if not capturing:
        return cp.asarray(host)
    out = _unpooled(host.shape, host.dtype)
    side = cp.cuda.Stream(non_blocking=True)
    out.set(np.ascontiguousarray(host), stream=side)
    side.synchronize()
    return out
