"""blutrain.kernels: the op catalogue, the conformance suite any backend runs against itself, and
optimized kernels."""

from blutrain.kernels.catalogue import CATALOGUE, OpInfo, get_op

__all__ = ["CATALOGUE", "OpInfo", "get_op"]
