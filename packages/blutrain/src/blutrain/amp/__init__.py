"""blutrain.amp: mixed precision. ``autocast(dtype=bfloat16)`` runs GEMMs and attention in bf16 and
norms, softmax and losses in float32, with float32 master weights (see ``blutrain.tensor.autocast``)."""

from blutrain.tensor.autocast import autocast, get_autocast_dtype

__all__ = ["autocast", "get_autocast_dtype"]
