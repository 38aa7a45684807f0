"""KVCache: the keys and values of the positions a decoder has already seen, for incremental decoding."""

from __future__ import annotations

from blutrain.nn.errors import ModuleError
from blutrain.tensor import Tensor, cat


class KVCache:
    """One (B, n_head, S, head_dim) key tensor and one value tensor per layer, for positions 0..S-1.

    Incremental decoding feeds only the positions not yet cached: each attention layer projects their
    keys and values, appends them here (:meth:`extend`) and lets their queries attend to every cached
    position, so a new token costs one position per layer instead of the whole context. The cached keys
    and values are exactly what a forward over the whole context would compute for those positions
    (causal attention: a position's key and value depend only on the positions before it), so decoding
    with a cache gives the logits of decoding without one, up to the rounding of the smaller GEMMs.

    Holds no gradient graph: a cache is for inference under ``no_grad``.
    """

    def __init__(self, n_layer: int) -> None:
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer <= 0:
            raise ModuleError(f"KVCache: n_layer must be a positive int, got {n_layer!r}")
        self._layers: list[tuple[Tensor, Tensor] | None] = [None] * n_layer

    @property
    def n_layer(self) -> int:
        return len(self._layers)

    @property
    def length(self) -> int:
        """Positions cached (the last layer's: every layer holds the same number between forwards)."""
        last = self._layers[-1]
        return 0 if last is None else int(last[0].shape[2])

    def extend(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append the (B, n_head, T, head_dim) ``key`` and ``value`` of T new positions to ``layer``'s
        cache; returns that layer's keys and values of every position so far."""
        if not 0 <= layer < len(self._layers):
            raise ModuleError(f"KVCache.extend: layer must be in [0, {len(self._layers)}), got {layer}")
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ModuleError(f"KVCache.extend: key and value must be (B, n_head, T, head_dim) with the same "
                              f"B, n_head and T, got {list(key.shape)} and {list(value.shape)}")
        held = self._layers[layer]
        if held is not None:
            if held[0].shape[:2] != key.shape[:2] or held[0].shape[3] != key.shape[3]:
                raise ModuleError(f"KVCache.extend: layer {layer} holds keys of shape {list(held[0].shape)}; new "
                                  f"keys {list(key.shape)} differ in batch, heads or head size")
            key, value = cat([held[0], key], dim=2), cat([held[1], value], dim=2)
        self._layers[layer] = (key, value)
        return key, value

    def clear(self) -> None:
        """Forget every position (the context window slid: every position's embedding changed)."""
        self._layers = [None] * len(self._layers)


__all__ = ["KVCache"]
