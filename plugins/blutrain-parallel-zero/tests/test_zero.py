"""ZeRO in a group of one (an MPI singleton): every stage trains as the unwrapped model does, stage 3 frees
parameters between uses, and misuse is reported by name. Multi-rank runs against the single process:
integration_tests/test_dist_zero.py."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain import nn
from blutrain.dist import DistArgumentError, DistError, ProcessGroup, merge_shards, parallel_modes
from blutrain.optim import create
from blutrain_parallel_zero import ZeRO, ZeroModel


def mlp() -> nn.Module:
    bt.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))


def train(model: nn.Module, optimizer, steps: int = 3) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for step in range(steps):
        x = bt.tensor(np.random.default_rng(step).standard_normal((5, 8)).astype(np.float32))
        loss = (model(x) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(float(loss.item()))
    return out


def test_the_plugin_registers_zero() -> None:
    assert parallel_modes().get("zero") is ZeRO


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_trains_as_the_unwrapped_model(group_of_one: ProcessGroup, stage: int) -> None:
    ref = mlp()
    ref_losses = train(ref, create("adamw", list(ref.parameters()), lr=1e-2))
    net = mlp()
    mode = ZeRO(group_of_one, stage=stage, bucket_cap_mb=(16 * 16 * 4) / 2**20)
    model = mode.wrap_model(net)
    optimizer = mode.wrap_optimizer(create("adamw", list(net.parameters()), lr=1e-2))
    np.testing.assert_allclose(train(model, optimizer), ref_losses, rtol=1e-6)
    state = model.state_dict()
    for name, p in ref.state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), p.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_gather_the_updated_parameters_when_they_are_next_read(group_of_one: ProcessGroup,
                                                                              stage: int) -> None:
    """The optimizer's step leaves the whole parameters behind the shards; gathered(), the next forward and
    state_dict bring them up to date, and each step's result is the unwrapped model's."""
    ref = mlp()
    ref_optimizer = create("adamw", list(ref.parameters()), lr=1e-2)
    train(ref, ref_optimizer, steps=1)
    net = mlp()
    before = [p.detach().numpy().copy() for p in net.parameters()]
    mode = ZeRO(group_of_one, stage=stage)
    model = mode.wrap_model(net)
    optimizer = mode.wrap_optimizer(create("adamw", list(net.parameters()), lr=1e-2))
    train(model, optimizer, steps=1)
    for p, old in zip(net.parameters(), before, strict=True):  # stale: the shards hold the update
        np.testing.assert_array_equal(p.detach().numpy(), old)
    with mode.gathered():
        for p, want in zip(net.parameters(), ref.parameters(), strict=True):
            np.testing.assert_allclose(p.detach().numpy(), want.detach().numpy(), rtol=1e-6, atol=1e-7)
    # the second step's forward gathers nothing new (up to date already); its update shows in state_dict
    assert train(model, optimizer, steps=1) == pytest.approx(train(ref, ref_optimizer, steps=1), rel=1e-6)
    state = model.state_dict()
    for name, want in ref.state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), want.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)


def test_stage_3_keeps_parameters_sharded_outside_forward_and_backward(group_of_one: ProcessGroup) -> None:
    net = mlp()
    model = ZeroModel(net, group_of_one, stage=3)
    assert [u.size for u in model.units] == [0, 2, 2, 2]  # the root, then each member of the Sequential
    assert [p.shape for p in net.parameters()] == [(0, 0), (0,)] * 3  # dims kept
    model(bt.ones(2, 8)).sum().backward()
    assert all(p.numel() == 0 and p.grad is None for p in net.parameters())
    assert all(float(bt.norm(b.shard_grad).item()) > 0 for b in model.buckets)


def test_a_sharded_state_merges_into_whole_optimizer_state(group_of_one: ProcessGroup) -> None:
    net = mlp()
    mode = ZeRO(group_of_one, stage=2)
    model = mode.wrap_model(net)
    optimizer = mode.wrap_optimizer(create("sgd", list(net.parameters()), lr=0.1, momentum=0.9))
    train(model, optimizer, steps=1)
    full, state = merge_shards([optimizer.state_shard()])
    assert sorted(full) == sorted(net.state_dict())
    assert sorted(state["state"]) == list(range(6)) and "momentum_buffer" in state["state"][0]


def test_a_parameter_without_gradient_is_named_at_the_next_forward(group_of_one: ProcessGroup) -> None:
    net = mlp()
    model = ZeroModel(net, group_of_one, stage=2)
    x = bt.ones(2, 8)
    net[1](net[0](x)).sum().backward()  # the last layer takes no part
    with pytest.raises(DistError, match=r"did not produce gradients for 2\.(bias|weight)"):
        model(x)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_with_the_ordered_reduction_trains_as_the_unwrapped_model(group_of_one: ProcessGroup,
                                                                               stage: int) -> None:
    """One rank's ordered reduce-scatter is its own gradient, bit for bit: the same losses and weights exactly."""
    ref = mlp()
    ref_losses = train(ref, create("adamw", list(ref.parameters()), lr=1e-2))
    net = mlp()
    mode = ZeRO(group_of_one, stage=stage, bucket_cap_mb=(16 * 16 * 4) / 2**20, reduce="ordered")
    model = mode.wrap_model(net)
    optimizer = mode.wrap_optimizer(create("adamw", list(net.parameters()), lr=1e-2))
    assert train(model, optimizer) == ref_losses
    state = model.state_dict()
    for name, p in ref.state_dict().items():
        np.testing.assert_array_equal(state[name].numpy(), p.numpy(), err_msg=name)


def test_an_unknown_reduction_is_refused_naming_the_choices(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match="ZeRO: reduce must be one of backend, ordered"):
        ZeRO.check_options(2, reduce="ring")
    with pytest.raises(DistArgumentError, match="ZeroModel: reduce must be one of backend, ordered"):
        ZeroModel(mlp(), group_of_one, stage=1, reduce="sum")
    ZeRO.check_options(1, reduce="ordered")


def test_stage_must_be_1_2_or_3(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistError, match="stage must be 1, 2 or 3, got 4"):
        ZeRO(group_of_one, stage=4)


def test_the_optimizer_is_wrapped_after_the_model(group_of_one: ProcessGroup) -> None:
    net = mlp()
    with pytest.raises(DistError, match="call wrap_model first"):
        ZeRO(group_of_one).wrap_optimizer(create("adamw", list(net.parameters())))


def test_zero_declares_sharded_gradients_and_state_and_no_mesh_form() -> None:
    assert (ZeRO.dim, ZeRO.compiles, ZeRO.shards_gradients, ZeRO.shards_state) == ("dp", True, True, True)
    assert ZeRO.splits_batch
    assert not (ZeRO.on_mesh or ZeRO.shards_loss or ZeRO.rewrites_layers)
    assert dict(ZeRO.mesh_options) == {"reduce": "reduce"}  # dp=4,zero=1,reduce=ordered
    with pytest.raises(DistArgumentError, match="ZeRO: stage must be 1, 2 or 3, got 4"):
        ZeRO.check_options(4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_modes_norm_and_state_are_its_optimizers_and_models(group_of_one: ProcessGroup, stage: int) -> None:
    mode = ZeRO(group_of_one, stage=stage)
    model = mode.wrap_model(mlp())
    optimizer = mode.wrap_optimizer(create("adamw", list(model.module.parameters()), lr=1e-2))
    x = bt.tensor(np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32))
    (model(x) ** 2).mean().backward()
    ref = mlp()
    (ref(x) ** 2).mean().backward()
    whole = float(bt.norm(bt.stack([bt.norm(p.grad) for p in ref.parameters()])).item())
    np.testing.assert_allclose(float(mode.grad_norm().item()), whole, rtol=1e-5)
    np.testing.assert_allclose(float(mode.clip_grad_norm_(whole / 2).item()), whole, rtol=1e-5)
    np.testing.assert_allclose(float(mode.grad_norm().item()), whole / 2, rtol=1e-5)  # clipped in place
    optimizer.step()
    optimizer.zero_grad()
    state = {k: v.detach().clone() for k, v in mode.full_state_dict().items()}
    shard = mode.state_shard(optimizer)
    merged_model, merged_optimizer = merge_shards([shard])
    for name, t in state.items():
        np.testing.assert_array_equal(merged_model[name].numpy(), t.numpy(), err_msg=name)
    other = ZeRO(group_of_one, stage=stage)
    fresh = other.wrap_model(mlp())
    fresh_optimizer = other.wrap_optimizer(create("adamw", list(fresh.module.parameters()), lr=1e-2))
    other.load_full_state(merged_model, fresh_optimizer, merged_optimizer)
    for name, t in other.full_state_dict().items():
        np.testing.assert_array_equal(t.numpy(), state[name].numpy(), err_msg=name)


def test_the_modes_capabilities_need_the_wrapped_model_and_optimizer(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match=r"ZeRO\.grad_norm: call wrap_model and wrap_optimizer first"):
        ZeRO(group_of_one).grad_norm()


class _Wrapper(nn.Module):
    """A model an inner mode of a mesh wrapped (as context parallelism does): its names gain ``module.``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        out: bt.Tensor = self.module(x)
        return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_a_mesh_state_is_named_as_the_single_process_model_names_it(group_of_one: ProcessGroup,
                                                                       stage: int) -> None:
    from blutrain.dist import DeviceMesh

    ref = mlp()
    ref_losses = train(ref, create("adamw", list(ref.parameters()), lr=1e-2))
    net = mlp()
    mode = ZeRO(DeviceMesh(group_of_one, {"dp": 1, "cp": 1}), stage=stage)
    mode.nest(net, None)  # no inner mode shards state: every tensor whole, named by net
    model = mode.wrap_model(_Wrapper(net))
    optimizer = mode.wrap_optimizer(create("adamw", list(net.parameters()), lr=1e-2))
    np.testing.assert_allclose(train(model, optimizer), ref_losses, rtol=1e-6)
    assert mode.state_dims == ("dp", "cp")  # context-parallel ranks hold replicas: ZeRO shards over them too
    full, optim_state = merge_shards([mode.state_shard(optimizer)])
    assert sorted(full) == sorted(ref.state_dict())
    for name, p in ref.state_dict().items():
        np.testing.assert_allclose(full[name].numpy(), p.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(mode.full_state_dict()[name].numpy(), p.numpy(), rtol=1e-6, atol=1e-7)
    again = ZeRO(DeviceMesh(group_of_one, {"dp": 1}), stage=stage)
    fresh = mlp()
    again.nest(fresh, None)
    again.wrap_model(_Wrapper(fresh))
    again_optimizer = again.wrap_optimizer(create("adamw", list(fresh.parameters()), lr=1e-2))
    again.load_full_state(full, again_optimizer, optim_state)
    reloaded, _ = merge_shards([again.state_shard(again_optimizer)])
    for name in full:
        np.testing.assert_array_equal(reloaded[name].numpy(), full[name].numpy(), err_msg=name)


def test_nesting_over_an_inner_mode_needs_a_mesh(group_of_one: ProcessGroup) -> None:
    from blutrain.dist import DeviceMesh

    inner = ZeRO(group_of_one, stage=1)
    with pytest.raises(DistArgumentError, match=r"ZeRO\.nest: nesting over mode ZeRO needs a DeviceMesh"):
        ZeRO(group_of_one, stage=1).nest(mlp(), inner)
    with pytest.raises(DistArgumentError, match="ZeRO must be the outermost mode that shards state"):
        ZeRO(DeviceMesh(group_of_one, {"dp": 1}), stage=1).nest(mlp(), inner)
