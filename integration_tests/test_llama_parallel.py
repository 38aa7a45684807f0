"""The tp and cp modes apply the Llama family's parallel plan (blutrain-model-llama): in a group of one (an MPI
singleton) the rewritten model gives the plain model's logits, loss and gradients, with the head untied or
tied, synchronous or async TP, and every context-parallel attention. Multi-rank runs of both:
test_plugin_matrix.py (llama-cpu-*-tp2-*, llama-cpu-*-cp2-*)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.dist import ProcessGroup, parallel_modes
from blutrain.models import model_spec


def tiny(tied: bool) -> Any:
    spec = model_spec("llama")
    bt.manual_seed(0)
    return spec.build(spec.config("tiny", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48, block_size=8,
                                  vocab_size=64, tie_embeddings=tied))


def grads_and_outputs(model: Any, wrapped: Any) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    tokens = np.random.default_rng(0).integers(0, 64, (2, 9))
    logits, loss = wrapped(bt.tensor(tokens[:, :-1]), bt.tensor(tokens[:, 1:]))
    loss.backward()
    return logits.detach().numpy(), loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("mode", "options"), [("tp", {}), ("tp", {"async_chunks": 2}), ("cp", {"attn": "ring"}),
                                               ("cp", {"attn": "allgather"}), ("cp", {"attn": "ulysses"})])
def test_the_mode_applied_to_llama_equals_the_plain_model(group_of_one: ProcessGroup, tied: bool, mode: str,
                                                          options: dict[str, Any]) -> None:
    ref = tiny(tied)
    want = grads_and_outputs(ref, ref)
    model = tiny(tied)
    wrapped = parallel_modes().get(mode)(group_of_one, **options).wrap_model(model)
    got = grads_and_outputs(model, wrapped)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    assert sorted(got[2]) == sorted(want[2])
    for name, g in want[2].items():
        np.testing.assert_allclose(got[2][name], g, rtol=1e-4, atol=1e-7, err_msg=name)
