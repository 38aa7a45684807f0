"""GPT-2: configuration, initialisation, forward/backward accuracy, checkpointing and sampling."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from blutrain.models import GPT2, GPT2Config, ModelError
from blutrain.tensor import Tensor, float64, from_numpy, manual_seed, rand, tensor

from .conftest import max_gradient_error, relative_error

SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61)


def _tokens(shape: tuple[int, ...], vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)


def _model(config: GPT2Config = SMALL, seed: int = 0) -> GPT2:
    manual_seed(seed)
    return GPT2(config)


def test_preset_applies_overrides_and_lists_presets_on_error() -> None:
    cfg = GPT2Config.preset("gpt2-124m", dropout=0.1)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (12, 12, 768, 1024, 50304)
    assert cfg.dropout == 0.1
    with pytest.raises(ModelError, match="unknown preset 'gpt3'; expected one of tiny, gpt2-124m, gpt2-350m, "
                                         "gpt2-774m, gpt2-1558m"):
        GPT2Config.preset("gpt3")
    with pytest.raises(ModelError, match="unknown field"):
        GPT2Config.preset("tiny", n_layers=3)


@pytest.mark.parametrize(("name", "layers", "width"), [("gpt2-350m", 24, 1024), ("gpt2-774m", 36, 1280),
                                                         ("gpt2-1558m", 48, 1600)])
def test_larger_presets_have_the_gpt2_shapes(name: str, layers: int, width: int) -> None:
    cfg = GPT2Config.preset(name)
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size) == (layers, width, 50304, 1024)


def test_config_rejects_inconsistent_sizes() -> None:
    with pytest.raises(ModelError, match=r"n_embd \(30\) must be divisible by n_head \(4\)"):
        GPT2Config(n_embd=30, n_head=4)
    with pytest.raises(ModelError, match="dropout must be in"):
        GPT2Config(dropout=1.0)


def test_config_round_trips_through_a_dict() -> None:
    cfg = GPT2Config.preset("tiny", checkpoint_activations=True)
    assert GPT2Config(**cfg.to_dict()) == cfg


def test_tiny_preset_is_small_enough_for_the_cpu_default_run() -> None:
    n = _model(GPT2Config.preset("tiny")).num_parameters()
    assert 0.5e6 < n < 5e6


def test_head_is_tied_to_the_token_embedding_and_counted_once() -> None:
    m = _model()
    assert m.lm_head.weight is m.transformer.wte.weight
    c = SMALL
    per_block = 2 * 2 * c.n_embd + (c.n_embd * 3 * c.n_embd + 3 * c.n_embd) + (c.n_embd**2 + c.n_embd) \
        + (c.n_embd * 4 * c.n_embd + 4 * c.n_embd) + (4 * c.n_embd * c.n_embd + c.n_embd)
    expected = c.vocab_size * c.n_embd + c.block_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    assert m.num_parameters() == expected
    assert m.num_parameters(non_embedding=True) == expected - c.block_size * c.n_embd
    assert "lm_head.weight" not in m.state_dict()


def test_initialisation_follows_gpt2() -> None:
    cfg = GPT2Config(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=300)
    m = _model(cfg)
    params = dict(m.named_parameters())
    std = {n: float(np.asarray(p.detach()).std()) for n, p in params.items()}
    assert abs(std["transformer.wte.weight"] - 0.02) < 0.002
    assert abs(std["transformer.h.0.attn.c_attn.weight"] - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(std["transformer.h.3.attn.c_proj.weight"] - residual) < 0.1 * residual
    assert abs(std["transformer.h.3.mlp.c_proj.weight"] - residual) < 0.1 * residual
    for name, p in params.items():
        values = np.asarray(p.detach())
        if name.endswith("bias"):
            np.testing.assert_array_equal(values, 0.0, err_msg=name)
        elif ".ln_" in name:
            np.testing.assert_array_equal(values, 1.0, err_msg=name)


def test_initialisation_is_reproducible_from_manual_seed() -> None:
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    wa, wb, wc = (np.asarray(m.transformer.h[0].mlp.c_fc.weight.detach()) for m in (a, b, c))
    np.testing.assert_array_equal(wa, wb)
    assert not np.array_equal(wa, wc)


def test_loss_is_cross_entropy_of_the_logits_ignoring_minus_one() -> None:
    m = _model().to(float64)
    x = _tokens((2, 8), SMALL.vocab_size)
    y = _tokens((2, 8), SMALL.vocab_size, seed=1)
    y[1, 3:] = -1
    logits, loss = m(from_numpy(x), from_numpy(y))
    assert logits.shape == (2, 8, SMALL.vocab_size) and loss is not None
    z = np.asarray(logits.detach()).reshape(-1, SMALL.vocab_size)
    t = y.reshape(-1)
    keep = t != -1
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    ref = (lse - z[np.arange(len(t)), np.where(keep, t, 0)])[keep].mean()
    assert abs(float(loss.item()) - ref) < 1e-12


def test_forward_without_targets_returns_logits_for_every_position_and_no_loss() -> None:
    logits, loss = _model()(from_numpy(_tokens((3, 5), SMALL.vocab_size)))
    assert logits.shape == (3, 5, SMALL.vocab_size) and loss is None


def test_forward_checks_its_inputs() -> None:
    m = _model()
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size 16"):
        m(from_numpy(_tokens((1, 17), SMALL.vocab_size)))
    with pytest.raises(TypeError, match="idx must be an integer Tensor of token ids, got float32"):
        m(rand(1, 4))
    with pytest.raises(ValueError, match=r"targets must have the shape of idx \[1, 4\], got \[1, 3\]"):
        m(tensor([[1, 2, 3, 4]]), tensor([[1, 2, 3]]))


def _float64_twin(m32: GPT2) -> GPT2:
    m64 = GPT2(m32.config).to(float64)
    m64.load_state_dict(m32.state_dict())
    return m64


def test_tiny_forward_backward_in_float32_matches_float64() -> None:
    cfg = GPT2Config.preset("tiny")
    m32 = _model(cfg)
    m64 = _float64_twin(m32)
    x = from_numpy(_tokens((4, 64), cfg.vocab_size))
    y = from_numpy(_tokens((4, 64), cfg.vocab_size, seed=1))
    _, loss32 = m32(x, y)
    _, loss64 = m64(x, y)
    assert loss32 is not None and loss64 is not None
    loss32.backward()
    loss64.backward()
    assert abs(float(loss32.item()) - float(loss64.item())) / float(loss64.item()) < 1e-5
    worst, where = max_gradient_error(m32, m64)
    assert worst < 1e-4, f"gradient of {where}: relative error {worst:.2e}"


def _backward_on_the_same_tokens(*models: GPT2, target_seed: int = 3) -> list[Tensor]:
    """Each model's loss (detached) on one batch of SMALL's tokens, after its backward has filled its gradients."""
    x = from_numpy(_tokens((2, 16), SMALL.vocab_size))
    y = from_numpy(_tokens((2, 16), SMALL.vocab_size, seed=target_seed))
    losses = []
    for m in models:
        _, loss = m(x, y)
        assert loss is not None
        loss.backward()
        losses.append(loss.detach())
    return losses


def _fused_against_plain(monkeypatch: pytest.MonkeyPatch, module: Any, op: str, hooked: tuple[str, ...],
                         calls_per_layer: int) -> None:
    """The model's fused path (``op`` of ``module`` counted) against the plain module path (a forward hook on
    each block's ``hooked`` submodules, as a user's would be): same loss and gradients in float64."""
    calls = []
    fused_op = getattr(module, op)
    monkeypatch.setattr(module, op, lambda *a: calls.append(1) or fused_op(*a))
    fused = _model().to(float64)
    plain = GPT2(SMALL).to(float64)
    plain.load_state_dict(fused.state_dict())
    for block in plain.transformer.h:
        for name in hooked:
            sub = block
            for part in name.split("."):
                sub = getattr(sub, part)
            sub.register_forward_hook(lambda module, args, out: None)
    losses = [float(loss.item()) for loss in _backward_on_the_same_tokens(fused, plain)]
    assert len(calls) == calls_per_layer * SMALL.n_layer  # the fused model only
    assert losses[0] == pytest.approx(losses[1], rel=1e-13)
    assert max_gradient_error(fused, plain)[0] < 1e-12
    assert sorted(fused.state_dict()) == sorted(plain.state_dict())


def test_mlp_fuses_c_fc_and_gelu_with_the_plain_modules_loss_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    import blutrain.models.gpt2 as gpt2_module

    _fused_against_plain(monkeypatch, gpt2_module, "linear_gelu", ("mlp.c_fc",), 1)


def test_blocks_add_the_residual_in_the_projections_with_the_plain_modules_loss_and_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block's two output projections add the residual in their GEMM (linear_add); a hook on attn and
    mlp sends the block down the plain ``x + branch(x)`` path."""
    import blutrain.nn.linear as linear_module

    _fused_against_plain(monkeypatch, linear_module, "linear_add", ("attn", "mlp"), 2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_packed_attention_gives_exactly_the_split_heads_loss_and_gradients(dtype: str) -> None:
    packed = _model()
    split = GPT2(SMALL)
    split.load_state_dict(packed.state_dict())
    for block in split.transformer.h:
        block.attn.packed = False
    if dtype == "float64":
        packed, split = packed.to(float64), split.to(float64)
    losses = [loss.numpy() for loss in _backward_on_the_same_tokens(packed, split)]
    assert losses[0] == losses[1]
    grads = dict(split.named_parameters())
    for name, p in packed.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        np.testing.assert_array_equal(p.grad.numpy(), grads[name].grad.numpy(), err_msg=name)


def test_activation_checkpointing_gives_the_same_loss_and_gradients() -> None:
    plain = _model().to(float64)
    ckpt = GPT2(GPT2Config(**{**SMALL.to_dict(), "checkpoint_activations": True})).to(float64)
    ckpt.load_state_dict(plain.state_dict())
    _backward_on_the_same_tokens(plain, ckpt, target_seed=2)
    assert max_gradient_error(ckpt, plain)[0] < 1e-12


def test_dropout_is_active_in_training_and_off_in_eval() -> None:
    m = _model(GPT2Config(**{**SMALL.to_dict(), "dropout": 0.2}))
    x = from_numpy(_tokens((2, 8), SMALL.vocab_size))
    a, _ = m(x)
    b, _ = m(x)
    assert relative_error(a, b) > 1e-3
    m.eval()
    c, _ = m(x)
    d, _ = m(x)
    np.testing.assert_array_equal(np.asarray(c.detach()), np.asarray(d.detach()))


def test_generate_with_a_seed_is_deterministic_and_leaves_the_global_generator_alone() -> None:
    m = _model()
    prompt = tensor([[1, 2, 3]])
    manual_seed(11)
    first = m.generate(prompt, 10, temperature=1.0, top_k=20, seed=5)
    after = np.asarray(rand(4))
    manual_seed(11)
    second = m.generate(prompt, 10, temperature=1.0, top_k=20, seed=5)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    np.testing.assert_array_equal(np.asarray(rand(4)), after)
    other = m.generate(prompt, 10, temperature=1.0, top_k=20, seed=6)
    assert first.shape == (1, 13) and not np.array_equal(np.asarray(first), np.asarray(other))
    np.testing.assert_array_equal(np.asarray(first)[:, :3], [[1, 2, 3]])


def test_generate_without_a_seed_follows_manual_seed() -> None:
    m = _model()
    manual_seed(2)
    a = m.generate(tensor([[0]]), 6)
    manual_seed(2)
    b = m.generate(tensor([[0]]), 6)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_top_k_one_is_greedy() -> None:
    m = _model()
    prompt = tensor([[4, 5], [6, 7]])
    greedy = m.generate(prompt, 5, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(m.generate(prompt, 5, top_k=1, seed=0)), np.asarray(greedy))
    logits, _ = m(prompt)
    np.testing.assert_array_equal(np.asarray(greedy)[:, 2], np.asarray(logits.detach())[:, -1].argmax(-1))


def test_generate_crops_the_context_to_block_size_and_restores_the_mode() -> None:
    m = _model()
    m.train()
    out = m.generate(tensor([[1] * 14]), 6, seed=0)
    assert out.shape == (1, 20) and m.training
    assert int(np.asarray(out).max()) < SMALL.vocab_size


def test_generate_rejects_bad_arguments() -> None:
    m = _model()
    with pytest.raises(ModelError, match="temperature must be a finite number >= 0, got -1"):
        m.generate(tensor([[1]]), 2, temperature=-1)
    with pytest.raises(ModelError, match="top_k must be a positive int or None, got 0"):
        m.generate(tensor([[1]]), 2, top_k=0)
    with pytest.raises(ModelError, match="max_new_tokens must be an int >= 0, got -3"):
        m.generate(tensor([[1]]), -3)


def test_loss_without_logits_equals_the_loss_of_the_logits_with_the_same_gradients() -> None:
    """return_logits=False fuses the head and the loss (linear_cross_entropy): no logits tensor, the
    same float64 loss and gradients, the tied embedding's two gradients summed as before."""
    x = from_numpy(_tokens((2, 16), SMALL.vocab_size))
    y_np = _tokens((2, 16), SMALL.vocab_size, seed=5)
    y_np[0, :4] = -1
    y = from_numpy(y_np)
    results = []
    for return_logits in (True, False):
        m = _model().to(float64)
        logits, loss = m(x, y, return_logits=return_logits)
        assert (logits is None) is (not return_logits) and loss is not None
        loss.backward()
        results.append((float(loss.item()), {n: p.grad.numpy() for n, p in m.named_parameters()
                                             if p.grad is not None}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert abs(loss - ref_loss) < 1e-12 and grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[name], rtol=1e-10, atol=1e-13, err_msg=name)
