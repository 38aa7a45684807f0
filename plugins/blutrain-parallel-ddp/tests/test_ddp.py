"""DDP in a group of one (an MPI singleton): buckets, gradients equal to the unwrapped model's,
no_sync, and the error for a parameter that got no gradient. Multi-rank runs against the single
process: integration_tests/test_dist_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain import nn
from blutrain.dist import DistArgumentError, DistError, ProcessGroup, parallel_modes
from blutrain_parallel_ddp import DDP, DistributedDataParallel


def mlp() -> nn.Module:
    bt.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))


def test_the_plugin_registers_ddp() -> None:
    assert parallel_modes().get("ddp") is DDP


def test_buckets_follow_reverse_parameter_order_and_the_size_cap(group_of_one: ProcessGroup) -> None:
    model = mlp()
    ddp = DistributedDataParallel(model, group_of_one, bucket_cap_mb=(16 * 16 * 4) / 2**20)
    names = [n for b in ddp.buckets for n in b.names]
    assert names == [n for n, _ in reversed(list(model.named_parameters()))]
    assert len(ddp.buckets) > 1
    for b in ddp.buckets[:-1]:
        assert sum(p.numel() for p in b.params) * 4 >= 16 * 16 * 4


def test_gradients_equal_the_unwrapped_model_and_accumulate_under_no_sync(group_of_one: ProcessGroup) -> None:
    x = bt.tensor(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32))
    ref = mlp()
    (ref(x).sum() * 2).backward()
    model = mlp()
    ddp = DistributedDataParallel(model, group_of_one, bucket_cap_mb=0.001)
    with ddp.no_sync():
        ddp(x).sum().backward()
    ddp(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-6, err_msg=name)


def test_a_parameter_without_gradient_is_named_at_the_next_forward(group_of_one: ProcessGroup) -> None:
    model = mlp()
    ddp = DistributedDataParallel(model, group_of_one)
    x = bt.ones(2, 8)
    hidden = model[1](model[0](x))  # the last layer takes no part
    hidden.sum().backward()
    with pytest.raises(DistError, match=r"did not produce gradients for 2\.bias, 2\.weight"):
        ddp(x)


def test_bucket_cap_must_be_positive(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistError, match="bucket_cap_mb must be a number > 0, got 0"):
        DistributedDataParallel(mlp(), group_of_one, bucket_cap_mb=0)


def test_bf16_gradient_averages_widen_back_into_float32_gradients(group_of_one: ProcessGroup) -> None:
    """In a group of one the average is the gradient itself: what comes back is its bf16 rounding, in float32."""
    x = bt.tensor(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32))
    ref = mlp()
    ref(x).sum().backward()
    model = mlp()
    ddp = DistributedDataParallel(model, group_of_one, bucket_cap_mb=0.001, grad_dtype="bf16")
    ddp(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and p.grad.dtype is bt.float32
        want = q.grad.numpy().astype(bt.bfloat16.np).astype(np.float32)
        np.testing.assert_array_equal(p.grad.numpy(), want, err_msg=name)
    assert "grad_dtype=bfloat16" in repr(ddp)


def test_an_unknown_gradient_dtype_is_refused_naming_the_choices(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistError, match="grad_dtype must be one of bf16, bfloat16, fp16, float16, fp32, float32, "
                                        "got 'int8'"):
        DistributedDataParallel(mlp(), group_of_one, grad_dtype="int8")
    with pytest.raises(DistError, match="ddp: grad_dtype must be one of"):
        DDP(group_of_one, grad_dtype="half")


def test_ddp_declares_the_mesh_form_along_dp_and_shards_nothing() -> None:
    assert (DDP.dim, DDP.compiles, DDP.on_mesh, DDP.mesh_order) == ("dp", True, True, 0)
    assert dict(DDP.mesh_options) == {"grad_dtype": "grad_dtype", "reduce": "reduce"}
    assert not (DDP.shards_loss or DDP.rewrites_layers or DDP.shards_gradients or DDP.shards_state)
    assert DDP.splits_batch  # the trainer gives each replica its own rows


def test_the_modes_no_sync_suspends_the_wrapped_models_averaging(group_of_one: ProcessGroup) -> None:
    mode = DDP(group_of_one)
    with mode.no_sync():  # before wrap_model: nothing to suspend
        pass
    model = mode.wrap_model(mlp())
    with mode.no_sync():
        assert model.averager.sync is False
    assert model.averager.sync is True


def test_ddp_refuses_a_grad_dtype_before_any_group_exists() -> None:
    with pytest.raises(DistArgumentError, match="ddp: grad_dtype must be one of"):
        DDP.check_options(grad_dtype="int8")
    DDP.check_options(25, grad_dtype="bf16")


def test_ordered_reduction_in_a_group_of_one_leaves_the_unwrapped_models_gradients(
        group_of_one: ProcessGroup) -> None:
    """One rank's rank-ordered average is its own gradient, through the flat copy and back, bit for bit (sizes
    that do not fill a chunk evenly are padded and the padding dropped)."""
    x = bt.tensor(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32))
    ref = mlp()
    ref(x).sum().backward()
    model = mlp()
    ddp = DistributedDataParallel(model, group_of_one, bucket_cap_mb=0.001, reduce="ordered")
    for _ in range(2):  # the buckets are made again in each backward pass
        model.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=name)
    assert "reduce=ordered" in repr(ddp)


def test_ordered_reduction_in_bf16_widens_back_into_float32_gradients(group_of_one: ProcessGroup) -> None:
    x = bt.tensor(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32))
    ref = mlp()
    ref(x).sum().backward()
    model = mlp()
    ddp = DistributedDataParallel(model, group_of_one, bucket_cap_mb=0.001, grad_dtype="bf16", reduce="ordered")
    ddp(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and p.grad.dtype is bt.float32
        want = q.grad.numpy().astype(bt.bfloat16.np).astype(np.float32)
        np.testing.assert_array_equal(p.grad.numpy(), want, err_msg=name)


def test_an_unknown_reduction_is_refused_naming_the_choices(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match="DistributedDataParallel: reduce must be one of backend, ordered "
                                                r"\(backend: .*; ordered: .*\), got 'fast'"):
        DistributedDataParallel(mlp(), group_of_one, reduce="fast")
    with pytest.raises(DistArgumentError, match="ddp: reduce must be one of backend, ordered"):
        DDP.check_options(reduce="nccl")
    with pytest.raises(DistArgumentError, match="got 1"):
        DDP(group_of_one, reduce=1)  # type: ignore[arg-type]
    DDP.check_options(25, grad_dtype="bf16", reduce="ordered")
