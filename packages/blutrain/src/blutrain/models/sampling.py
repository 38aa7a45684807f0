"""Autoregressive sampling for any :class:`blutrain.models.Model`: the loop of ``model.generate``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from blutrain.autograd import no_grad
from blutrain.models.errors import ModelError
from blutrain.nn import KVCache
from blutrain.tensor import Tensor, cat, float64, from_numpy, rand


def sample_tokens(model: Any, idx: Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                  seed: int | None, head: Callable[[Tensor], Tensor],
                  decode: Callable[[Tensor, KVCache], Tensor] | None = None) -> Tensor:
    """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return the (B, T + new) ids.

    Each step runs ``model.hidden_states`` on the context (the last ``config.block_size`` tokens) and
    ``head`` on its last position only. With ``decode`` (hidden states of the positions that follow a
    :class:`~blutrain.nn.KVCache`'s, appending theirs to it) the prompt runs once and each later step only
    the newest token; once the sequence outgrows ``block_size`` the window slides, every position's
    embedding changes, and each later step recomputes the cropped context (as without the cache).
    Runs in eval mode under ``no_grad`` (the previous mode is restored). ``temperature=0`` picks the most
    likely token; ``top_k`` keeps the k most likely. With ``seed`` the draws come from a dedicated
    generator, so the result depends only on the model, the prompt and the seed, and the default generator
    is left untouched; without it they come from the device's default generator (``manual_seed``).
    Sampling happens on the host: one (B, vocab) copy per token, which is cheap next to a forward.
    """
    model.check_ids(idx, check_length=False)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ModelError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0 or not math.isfinite(temperature):
        raise ModelError(f"generate: temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ModelError(f"generate: top_k must be a positive int or None, got {top_k!r}")
    rng = np.random.Generator(np.random.Philox(seed)) if seed is not None else None
    block = model.config.block_size
    cache = KVCache(model.config.n_layer) if decode is not None else None
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            for _ in range(max_new_tokens):
                if cache is None or decode is None:
                    context = idx if idx.shape[1] <= block else idx[:, -block:]
                    hidden = model.hidden_states(context).select(1, -1)
                else:
                    if idx.shape[1] > block:  # the window slid: no cached position keeps its place
                        cache.clear()
                    context = idx[:, -block:] if cache.length == 0 else idx[:, cache.length:]
                    hidden = decode(context, cache).select(1, -1)
                logits = np.asarray(head(hidden), dtype=np.float64)
                u: np.ndarray[Any, Any]
                if rng is not None:
                    u = rng.random((logits.shape[0],))
                else:
                    u = np.asarray(rand(logits.shape[0], dtype=float64, device=idx.device))
                nxt = sample_from_logits(logits, temperature, top_k, u)
                step = from_numpy(nxt.reshape(-1, 1).astype(idx.dtype.np)).to(idx.device)
                idx = cat([idx, step], dim=1)
    finally:
        model.train(was_training)
    return idx


def sample_from_logits(logits: np.ndarray[Any, Any], temperature: float, top_k: int | None,
            u: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One token per row of float64 ``logits`` by inverse-CDF sampling with uniforms ``u``."""
    if temperature == 0:
        return np.asarray(np.argmax(logits, axis=1))
    z = logits / temperature
    if top_k is not None and top_k < z.shape[1]:
        kth = np.partition(z, -top_k, axis=1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1)
    picks = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=1)
    return np.asarray(np.minimum(picks, z.shape[1] - 1))


__all__ = ["sample_from_logits", "sample_tokens"]
