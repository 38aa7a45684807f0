"""The optimizer base class, the registry, and state dicts that resume exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain import nn
from blutrain.optim import (
    Optimizer,
    OptimizerError,
    OptimizerProtocol,
    OptimizerRegistry,
    StepScalars,
    create,
    multi_tensor_apply,
    optimizers,
    weight_decay_groups,
)
from blutrain.tensor import (
    NotRegisteredError,
    PluginError,
    Tensor,
    device,
    float32,
    float64,
    manual_seed,
    ones,
    randn,
    tensor,
)
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered, plugins_blocked


class Halve(Optimizer):
    """A minimal optimizer on the base class: p ← p − lr·g, counting steps in its state."""

    def __init__(self, params: Any, lr: float = 0.5, tag: str = "x") -> None:
        super().__init__(params, {"lr": lr, "tag": tag})

    def step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    st = self.state.setdefault(p, {"n": 0})
                    st["n"] += 1
                    p.detach().sub_(p.grad * g["lr"])


def _model() -> nn.Module:
    manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU("tanh"), nn.LayerNorm(8), nn.Linear(8, 2))


def _train(model: nn.Module, opt: Any, steps: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x = tensor(rng.normal(size=(5, 4)).astype(np.float32))
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def test_builtin_optimizers_are_registered_by_their_plugins() -> None:
    reg = optimizers()
    assert {"adamw", "sgd"} <= set(reg.names())
    assert reg.provider("adamw").distribution == "blutrain-optim-adamw"
    assert reg.provider("sgd").distribution == "blutrain-optim-sgd"


def test_the_base_class_declares_no_trainer_defaults() -> None:
    assert dict(Optimizer.trainer_defaults) == {}
    assert dict(optimizers().get("sgd").trainer_defaults) == {}  # SGD's constructor defaults stand


def test_a_class_lacking_a_protocol_member_is_refused_when_it_registers() -> None:
    class StepOnly:
        def step(self) -> None: ...

    with pytest.raises(PluginError, match=r"optimizer 'steponly' \(StepOnly\) lacks trainer_defaults, zero_grad, "
                                          r"state_dict, load_state_dict of blutrain.optim.OptimizerProtocol"):
        OptimizerRegistry().register("steponly", StepOnly)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_create_builds_an_optimizer_by_name_that_trains(name: str) -> None:
    model = _model()
    opt = create(name, model.parameters(), lr=0.05)
    assert isinstance(opt, OptimizerProtocol)
    losses = _train(model, opt, 20)
    assert losses[-1] < 0.5 * losses[0]


def test_create_with_an_unknown_name_lists_the_installed_optimizers() -> None:
    with pytest.raises(NotRegisteredError,
                       match=r"no optimizer 'lamb'; installed: adamw \(blutrain-optim-adamw"):
        create("lamb", _model().parameters())


@pytest.fixture
def third_party() -> Iterator[str]:
    class ThirdParty:
        @hookimpl
        def blutrain_register_optimizers(self, registry: Any) -> None:
            registry.register("halve", Halve)

    with plugin_registered(ThirdParty(), "halve-plugin"):
        yield "halve"


def test_a_third_party_optimizer_registered_at_run_time_is_selectable_by_name(third_party: str) -> None:
    model = _model()
    opt = create(third_party, model.parameters(), lr=0.1)
    assert isinstance(opt, Halve) and opt.param_groups[0]["lr"] == 0.1
    assert "halve (halve-plugin)" in optimizers().describe()
    losses = _train(model, opt, 5)
    assert losses[-1] < losses[0]


def test_groups_take_missing_hyperparameters_from_the_defaults() -> None:
    a, b = nn.Parameter(randn(2)), nn.Parameter(randn(2))
    opt = Halve([{"params": [a], "lr": 0.1}, {"params": b}], lr=0.3)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]
    assert opt.param_groups[1]["tag"] == "x" and opt.param_groups[1]["params"] == [b]


def test_parameter_lists_are_checked() -> None:
    p = nn.Parameter(randn(2))
    with pytest.raises(OptimizerError, match="Halve: got an empty parameter list"):
        Halve([])
    with pytest.raises(OptimizerError, match="group 1 repeats a parameter"):
        Halve([{"params": [p]}, {"params": [p]}])
    with pytest.raises(OptimizerError, match="got a single Tensor; pass \\[tensor\\]"):
        Halve(p)
    with pytest.raises(OptimizerError, match="parameters must be floating"):
        Halve([tensor([1, 2])])
    with pytest.raises(OptimizerError, match="lr must be a number >= 0, got -1"):
        Halve([p], lr=-1)


def test_zero_grad_drops_or_zeroes_gradients() -> None:
    model = _model()
    opt = Halve(model.parameters())
    (model(randn(2, 4)) ** 2).sum().backward()
    p = next(iter(model.parameters()))
    grad = p.grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is grad and not np.asarray(grad).any()
    opt.zero_grad()
    assert all(q.grad is None for q in model.parameters())


def _json_round_trip(sd: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint does to a state dict: tensors aside, JSON (int keys → str, tuples → lists)."""
    tensors: dict[str, Tensor] = {}

    def strip(v: Any, key: str) -> Any:
        if isinstance(v, Tensor):
            tensors[key] = v.clone()
            return {"__tensor__": key}
        if isinstance(v, dict):
            return {str(k): strip(x, f"{key}.{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [strip(x, f"{key}.{i}") for i, x in enumerate(v)]
        return v

    def put(v: Any) -> Any:
        if isinstance(v, dict):
            return tensors[v["__tensor__"]] if set(v) == {"__tensor__"} else {k: put(x) for k, x in v.items()}
        if isinstance(v, list):
            return [put(x) for x in v]
        return v

    return put(json.loads(json.dumps(strip(sd, "o"))))  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_state_dict_resumes_exactly_after_a_checkpoint_round_trip(name: str) -> None:
    kw: dict[str, Any] = {"lr": 0.01, "weight_decay": 0.1}
    if name == "sgd":
        kw.update(momentum=0.9, nesterov=True)
    model = _model()
    opt = create(name, model.parameters(), **kw)
    _train(model, opt, 3)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = _json_round_trip(opt.state_dict())
    expected = _train(model, opt, 3, seed=1)

    fresh = _model()
    fresh.load_state_dict(saved_model)
    fresh_opt = create(name, fresh.parameters(), **{**kw, "lr": 99.0})
    fresh_opt.load_state_dict(saved_opt)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert _train(fresh, fresh_opt, 3, seed=1) == expected
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        np.testing.assert_array_equal(np.asarray(a.detach()), np.asarray(b.detach()))


def test_state_dict_names_parameters_by_position() -> None:
    model = _model()
    opt = create("adamw", model.parameters(), lr=0.01)
    _train(model, opt, 1)
    sd = opt.state_dict()
    n = len(list(model.parameters()))
    assert sorted(sd["state"]) == list(range(n))
    assert sorted(i for g in sd["param_groups"] for i in g["params"]) == list(range(n))
    assert sd["state"][0]["step"] == 1


def test_load_state_dict_rejects_a_different_layout() -> None:
    model = _model()
    opt = create("adamw", model.parameters(), lr=0.01)
    _train(model, opt, 1)
    sd = opt.state_dict()
    other = create("adamw", [{"params": list(model.parameters())}], lr=0.01)
    with pytest.raises(OptimizerError, match="the state dict has 2 parameter groups, the optimizer has 1"):
        other.load_state_dict(sd)
    sd["state"][0]["exp_avg"] = ones(7)
    with pytest.raises(OptimizerError,
                       match=r"state 'exp_avg' of parameter 0 has shape \[7\], the parameter has"):
        opt.load_state_dict(sd)


def test_load_state_dict_moves_state_to_the_parameter_dtype() -> None:
    model = _model()
    opt = create("adamw", model.parameters(), lr=0.01)
    _train(model, opt, 1)
    sd = opt.state_dict()
    sd["state"] = {k: {n: (v.to(float64) if isinstance(v, Tensor) else v) for n, v in s.items()}
                   for k, s in sd["state"].items()}
    opt.load_state_dict(sd)
    assert all(s["exp_avg"].dtype is float32 for s in opt.state.values())


def test_weight_decay_groups_decay_matrices_and_embeddings_but_not_vectors() -> None:
    emb = nn.Embedding(5, 4)
    model = nn.Sequential(emb, nn.LayerNorm(4), nn.Linear(4, 4))
    groups = weight_decay_groups(model.parameters(), 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [p.ndim for p in groups[0]["params"]] == [2, 2] and groups[0]["params"][0] is emb.weight
    assert [p.ndim for p in groups[1]["params"]] == [1, 1, 1]


def test_multi_tensor_apply_bumps_versions_and_checks_dtypes() -> None:
    p32, g32 = nn.Parameter(ones(3)), ones(3)
    before = p32.version
    lr = np.array([0.5])
    multi_tensor_apply("sgd_multi_tensor", [[p32], [g32], []], lr, 0.0, 0.0, 0.0, False, False, written=(0,))
    assert p32.version == before + 1
    np.testing.assert_array_equal(np.asarray(p32.detach()), 0.5)
    with pytest.raises(OptimizerError, match="every tensor must be on cpu with dtype float32, got one on cpu "
                                             "with dtype float64"):
        multi_tensor_apply("sgd_multi_tensor", [[p32], [ones(3, dtype=float64)], []], lr, 0.0, 0.0, 0.0,
                           False, False, written=(0,))


def test_step_scalars_keep_one_float64_array_per_site_refilled_in_place() -> None:
    scalars, cpu = StepScalars(), device("cpu")
    first = scalars((0, 0), cpu, (1e-3, 0.1))
    again = scalars((0, 0), cpu, (2e-3, 0.19))
    assert again is first and first.dtype == np.float64 and first.tolist() == [2e-3, 0.19]
    assert scalars((1, 0), cpu, (2e-3, 0.19)) is not first


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(allow_nan=False), min_size=3, max_size=3), min_size=1, max_size=6))
def test_step_scalars_hold_each_steps_values_in_the_first_array(steps: list[list[float]]) -> None:
    scalars, cpu = StepScalars(), device("cpu")
    first = scalars("site", cpu, steps[0])
    for values in steps:
        array = scalars("site", cpu, values)
        assert array is first
        np.testing.assert_array_equal(array, np.array(values, np.float64))


def test_a_kernel_reads_the_values_step_scalars_wrote_in_place() -> None:
    scalars, cpu = StepScalars(), device("cpu")
    p, g = nn.Parameter(ones(3, dtype=float64)), ones(3, dtype=float64)
    arrays, expected = [], 1.0
    for lr in (0.5, 0.25, 0.125):  # p ← p − lr·g, each step with its own lr
        arrays.append(scalars((0, 0), cpu, (lr,)))
        multi_tensor_apply("sgd_multi_tensor", [[p], [g], []], arrays[-1], 0.0, 0.0, 0.0, False, False,
                           written=(0,))
        expected -= lr
        np.testing.assert_array_equal(np.asarray(p.detach()), expected)
    assert all(a is arrays[0] for a in arrays)


def test_step_scalars_allocate_anew_when_the_number_of_values_changes() -> None:
    scalars, cpu = StepScalars(), device("cpu")
    first = scalars("site", cpu, (1.0,))
    longer = scalars("site", cpu, (1.0, 2.0))
    assert longer is not first and longer.tolist() == [1.0, 2.0] and first.tolist() == [1.0]
    assert scalars("site", cpu, (3.0, 4.0)) is longer and longer.tolist() == [3.0, 4.0]


@pytest.fixture
def without_plugins() -> Iterator[None]:
    """The project's optimizer plugins blocked, as where only the blutrain facade is installed."""
    with plugins_blocked("adamw", "sgd"):
        yield


@pytest.mark.usefixtures("without_plugins")
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_missing_project_optimizer_names_its_package(name: str) -> None:
    with pytest.raises(NotRegisteredError, match=rf"no optimizer '{name}'; installed: none; install "
                                                 rf"blutrain-optim-{name}$"):
        create(name, _model().parameters())
