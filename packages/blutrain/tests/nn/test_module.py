"""Module: registration by attribute, traversal, state dicts, modes, hooks, placement."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from blutrain import nn
from blutrain.autograd import no_grad
from blutrain.tensor import Tensor, float32, float64, manual_seed, ones, randn, tensor, zeros


class Pair(nn.Module):
    """Two linears sharing one weight, a buffer and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("count", zeros(1, dtype="int64"))
        self.register_buffer("scratch", ones(2), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(self.a(x))
        return out


def test_assigning_parameters_and_modules_registers_them_by_name() -> None:
    m = Pair()
    assert [n for n, _ in m.named_children()] == ["a", "b"]
    assert [n for n, _ in m.named_modules()] == ["", "a", "b"]
    assert [n for n, _ in m.named_buffers()] == ["count", "scratch"]
    assert isinstance(m.a.weight, nn.Parameter) and m.a.weight.requires_grad


def test_tied_parameters_appear_once() -> None:
    m = Pair()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["a.weight", "a.bias"]
    assert len(list(m.parameters())) == 2
    assert len(list(m.named_parameters(remove_duplicate=False))) == 3


def test_parameter_shares_storage_and_requires_grad() -> None:
    t = randn(2, 2)
    p = nn.Parameter(t)
    assert p.requires_grad and p.data_ptr() == t.data_ptr()
    assert not nn.Parameter(t, requires_grad=False).requires_grad
    with pytest.raises(TypeError, match="Parameter: data must be a Tensor"):
        nn.Parameter([1.0])  # type: ignore[arg-type]


def test_assigning_a_plain_tensor_to_a_parameter_name_is_an_error() -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(nn.ModuleError,
                       match=r"Linear\.weight is a parameter: assign a Parameter or None, got Tensor"):
        m.weight = randn(2, 2)  # type: ignore[assignment]


def test_assigning_before_super_init_names_the_fix() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            self.w = nn.Parameter(randn(2))

    with pytest.raises(nn.ModuleError, match=r"call super\(\).__init__\(\) first"):
        Broken()


def test_state_dict_holds_parameters_once_and_persistent_buffers() -> None:
    sd = Pair().state_dict()
    assert list(sd) == ["count", "a.weight", "a.bias"]  # own state first, then children
    assert all(not t.requires_grad for t in sd.values())


def test_load_state_dict_copies_values_in_place() -> None:
    src, dst = Pair(), Pair()
    weight = dst.a.weight
    dst.load_state_dict(src.state_dict())
    assert dst.a.weight is weight
    np.testing.assert_array_equal(np.asarray(dst.a.weight), np.asarray(src.a.weight))
    np.testing.assert_array_equal(np.asarray(dst.b.weight), np.asarray(src.a.weight))


def test_load_state_dict_accepts_the_other_name_of_a_tied_weight() -> None:
    src, dst = Pair(), Pair()
    sd = src.state_dict()
    sd["b.weight"] = sd.pop("a.weight")
    dst.load_state_dict(sd)
    np.testing.assert_array_equal(np.asarray(dst.a.weight), np.asarray(src.a.weight))


def test_load_state_dict_names_missing_and_unexpected_keys() -> None:
    m = Pair()
    sd = m.state_dict()
    del sd["a.bias"]
    sd["c.weight"] = randn(3)
    with pytest.raises(nn.StateDictError, match=r"missing keys: a.bias; unexpected keys: c.weight"):
        m.load_state_dict(sd)


def test_load_state_dict_non_strict_returns_the_mismatches() -> None:
    m = Pair()
    sd = m.state_dict()
    del sd["count"]
    sd["extra"] = randn(1)
    result = m.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["count"]
    assert result.unexpected_keys == ["extra"]


def test_load_state_dict_rejects_a_mis_shaped_tensor_even_when_not_strict() -> None:
    m = Pair()
    before = np.asarray(m.a.bias).copy()
    sd = m.state_dict()
    sd["a.weight"] = randn(3, 4)
    sd["a.bias"] = zeros(3)
    with pytest.raises(nn.StateDictError, match=r"'a.weight': expected shape \[3, 3\], got \[3, 4\]"):
        m.load_state_dict(sd, strict=False)
    np.testing.assert_array_equal(np.asarray(m.a.bias), before)  # nothing was copied


def test_load_state_dict_casts_to_the_parameter_dtype() -> None:
    m = nn.Linear(2, 2)
    sd = {k: v.to(float64) for k, v in m.state_dict().items()}
    m.load_state_dict(sd)
    assert m.weight.dtype is float32


def test_train_and_eval_reach_every_submodule() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    m.eval()
    assert not any(sub.training for sub in m.modules())
    m.train()
    assert all(sub.training for sub in m.modules())


def test_dropout_is_identity_in_eval_mode_only() -> None:
    manual_seed(0)
    d = nn.Dropout(0.5)
    x = ones(1000)
    dropped = np.asarray(d(x))
    assert 300 < (dropped == 0).sum() < 700
    np.testing.assert_array_equal(dropped[dropped != 0], 2.0)
    d.eval()
    assert d(x) is x


def test_forward_pre_hook_can_replace_the_arguments_and_be_removed() -> None:
    m = nn.Linear(2, 2, bias=False)
    x = randn(1, 2)
    handle = m.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
    np.testing.assert_array_equal(np.asarray(m(x)), 0.0)
    handle.remove()
    assert np.abs(np.asarray(m(x))).sum() > 0


def test_forward_hook_sees_args_and_output_and_can_replace_the_output() -> None:
    m = nn.Linear(2, 2)
    seen: list[Any] = []

    def hook(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        seen.append((mod, args[0].shape, out.shape))
        return out + 1

    x = randn(4, 2)
    expected = np.asarray(nn.functional.linear(x, m.weight, m.bias).detach()) + 1
    m.register_forward_hook(hook)
    np.testing.assert_allclose(np.asarray(m(x).detach()), expected)
    assert seen == [(m, (4, 2), (4, 2))]


def test_to_dtype_keeps_parameter_identity_requires_grad_and_grads() -> None:
    m = Pair()
    weight = m.a.weight
    m(randn(2, 3)).sum().backward()
    m.to(float64)
    assert m.a.weight is weight and m.b.weight is weight
    assert weight.dtype is float64 and weight.requires_grad
    assert weight.grad is not None and weight.grad.dtype is float64
    assert m.count.dtype.name == "int64"  # integer buffers keep their dtype
    assert m.scratch.dtype is float64
    m.zero_grad()
    m(randn(2, 3, dtype=float64)).sum().backward()
    assert weight.grad is not None and weight.grad.dtype is float64


def test_to_accepts_device_and_dtype_strings() -> None:
    m = nn.Linear(2, 2).to("cpu", "float64")
    assert m.weight.dtype is float64 and str(m.weight.device) == "cpu"


def test_zero_grad_sets_to_none_or_zeroes_in_place() -> None:
    m = nn.Linear(2, 2)
    m(randn(3, 2)).sum().backward()
    grad = m.weight.grad
    m.zero_grad(set_to_none=False)
    assert m.weight.grad is grad
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    m.zero_grad()
    assert m.weight.grad is None and m.bias is not None and m.bias.grad is None


def test_modules_visit_shared_submodules_once() -> None:
    shared = nn.Linear(2, 2)
    m = nn.Sequential(shared, shared)
    assert len(list(m.modules())) == 2
    assert len(list(m.children())) == 1


def test_apply_reaches_every_module() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def zero(mod: nn.Module) -> None:
        if isinstance(mod, nn.Linear):
            nn.init.zeros_(mod.weight)

    m.apply(zero)
    assert all(np.all(np.asarray(p.detach()) == 0) for n, p in m.named_parameters() if n.endswith("weight"))


def test_deleting_an_attribute_unregisters_it() -> None:
    m = nn.Linear(2, 2)
    del m.bias
    assert [n for n, _ in m.named_parameters()] == ["weight"]


def test_register_buffer_rejects_a_parameter_name_clash() -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(nn.ModuleError, match="'weight' is already a parameter or submodule"):
        m.register_buffer("weight", zeros(2))


def test_repr_shows_the_tree() -> None:
    text = repr(nn.Sequential(nn.Linear(2, 3), nn.GELU("tanh")))
    assert "(0): Linear(in_features=2, out_features=3, bias=True)" in text
    assert "(1): GELU(approximate='tanh')" in text


def test_requires_grad_false_freezes_every_parameter() -> None:
    m = nn.Linear(2, 2).requires_grad_(False)
    assert not any(p.requires_grad for p in m.parameters())
    with no_grad():
        assert m(tensor([[1.0, 2.0]])).shape == (1, 2)
