"""blutrain.kernels: the op catalogue, the conformance suite any backend runs against itself, and
optimized kernels."""

from blutrain.kernels.catalogue import CATALOGUE, Arg, OpInfo, Sample, get_op

__all__ = ["CATALOGUE", "Arg", "OpInfo", "Sample", "get_op"]
