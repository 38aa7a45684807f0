"""Incremental decoding: the KV cache gives what the whole forward gives, and generate uses it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.autograd import no_grad
from blutrain.models import GPT2, GPT2Config
from blutrain.nn import KVCache, ModuleError
from blutrain.tensor import float64, from_numpy, manual_seed, tensor, zeros

SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61)


def _model(dtype: str | None = None) -> GPT2:
    manual_seed(0)
    m = GPT2(SMALL)
    m.eval()
    return m.to(dtype=float64) if dtype == "float64" else m


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SMALL.vocab_size, size=(2, n), dtype=np.int64)


@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_decoding_in_chunks_equals_the_whole_forward_in_float64(cuts: list[int]) -> None:
    """Any split of a sequence (at most block_size 16) into chunks (one token, several, the whole prompt)
    decoded one chunk after another through the cache gives the hidden states of one forward over the whole
    sequence."""
    m = _model("float64")
    ids = _tokens(sum(cuts))
    with no_grad():
        whole = np.asarray(m.transformer(from_numpy(ids)))
        cache = KVCache(SMALL.n_layer)
        parts, start = [], 0
        for n in cuts:
            parts.append(np.asarray(m.transformer.decode(from_numpy(ids[:, start:start + n]), cache)))
            start += n
    assert cache.length == sum(cuts)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prompt_len", [1, 3, 15])  # 15: the window slides after the first new token
def test_cached_and_uncached_generation_give_the_same_tokens_for_a_seed(prompt_len: int) -> None:
    m = _model()
    prompt = from_numpy(_tokens(prompt_len, seed=prompt_len))
    for seed in range(3):
        cached = m.generate(prompt, 20, temperature=1.0, seed=seed)
        uncached = m.generate(prompt, 20, temperature=1.0, seed=seed, use_cache=False)
        np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))


def test_a_hook_on_an_attention_makes_generate_run_the_whole_forward() -> None:
    m = _model()
    calls: list[int] = []
    m.transformer.h[0].attn.register_forward_hook(lambda module, args, out: calls.append(1))
    assert not m.transformer.decodes_incrementally()
    out = m.generate(tensor([[1, 2]]), 3, seed=0)
    assert out.shape == (1, 5) and len(calls) == 3  # one whole forward per new token, each through the hook


def test_decode_refuses_more_positions_than_the_block() -> None:
    m = _model()
    cache = KVCache(SMALL.n_layer)
    with no_grad():
        m.transformer.decode(from_numpy(_tokens(10)), cache)
        with pytest.raises(Exception, match="10 cached \\+ 7 new positions exceed block_size 16"):
            m.transformer.decode(from_numpy(_tokens(7)), cache)


def test_kv_cache_rejects_keys_that_do_not_fit() -> None:
    cache = KVCache(2)
    cache.extend(0, zeros(1, 2, 3, 4), zeros(1, 2, 3, 4))
    with pytest.raises(ModuleError, match="differ in batch, heads or head size"):
        cache.extend(0, zeros(1, 3, 1, 4), zeros(1, 3, 1, 4))
    with pytest.raises(ModuleError, match=r"layer must be in \[0, 2\), got 2"):
        cache.extend(2, zeros(1, 2, 1, 4), zeros(1, 2, 1, 4))
    with pytest.raises(ModuleError, match="n_layer must be a positive int"):
        KVCache(0)
    cache.clear()
    assert cache.length == 0
