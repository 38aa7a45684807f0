"""A family's parallel plan names real layers: paths resolve, a wrong one is an error naming it, and
replacing a module through a path puts it there."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError
from blutrain.models import (
    GPT2,
    GPT2Config,
    ModelError,
    ModelParallelPlan,
    model_spec,
    module_at,
    plan_of,
    replace_module,
    require_plan,
)
from blutrain.nn import CausalSelfAttention, Embedding, Linear


def tiny() -> GPT2:
    bt.manual_seed(0)
    return GPT2(GPT2Config.preset("tiny", n_layer=2, n_head=2, n_embd=16, block_size=8))


def test_every_path_of_the_gpt2_plan_names_a_layer_of_its_kind() -> None:
    model = tiny()
    plan = model_spec("gpt2").parallel_plan
    assert isinstance(plan, ModelParallelPlan)
    blocks = list(plan.block_modules(model))
    assert [p for p, _ in blocks] == ["transformer.h.0", "transformer.h.1"]
    for _, block in blocks:
        for path in [*plan.column, *plan.row]:
            assert isinstance(module_at(block, path), Linear)
    assert all(isinstance(a, CausalSelfAttention) for _, a in plan.attentions(model))
    assert isinstance(module_at(model, plan.vocab_embedding), Embedding)
    assert module_at(model, plan.head).weight is module_at(model, plan.vocab_embedding).weight  # tied


def test_a_missing_path_is_an_error_naming_it() -> None:
    with pytest.raises(ModelError, match=r"GPT2 has no module at 'transformer.h.0.mlp.w1' \(no 'w1' in MLP\)"):
        module_at(tiny(), "transformer.h.0.mlp.w1")


def test_replace_module_puts_the_new_module_at_the_path() -> None:
    model = tiny()
    new = Linear(16, 64)
    replace_module(model, "transformer.h.1.mlp.c_fc", new)
    assert module_at(model, "transformer.h.1.mlp.c_fc") is new
    assert model.transformer.h[1].mlp.c_fc is new


def test_an_attention_core_replaces_only_the_attention_step() -> None:
    model = tiny()
    x = bt.randn(2, 8, 16)
    attn = model.transformer.h[0].attn
    want = attn(x)
    seen: list[tuple[int, ...]] = []

    def core(q: bt.Tensor, k: bt.Tensor, v: bt.Tensor) -> bt.Tensor:
        seen.append(tuple(q.shape))
        return bt.scaled_dot_product_attention(q, k, v, is_causal=True)

    attn.attention_core = core
    got = attn(x)
    assert seen == [(2, 2, 8, 8)]
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_plan_of_gives_a_models_plan_and_none_for_anything_else() -> None:
    assert plan_of(tiny()) is GPT2.parallel_plan
    assert plan_of(Linear(2, 2)) is None and plan_of("transformer") is None


def test_require_plan_gives_the_plan_or_an_error_naming_the_mode_and_what_it_got() -> None:
    assert require_plan("TP", tiny()) is GPT2.parallel_plan
    with pytest.raises(DistArgumentError, match=r"^CP: model must be a blutrain.models.Model with a parallel_plan "
                                                r"\(a ModelParallelPlan\), got Linear; register the family with one$"):
        require_plan("CP", Linear(2, 2))
