"""Tensor parallelism in one process (an MPI singleton): slicing by heads, the rewritten GPT-2 equal to
the plain one, the vocab-parallel cross-entropy against float64, and argument errors. Multi-rank runs
against the single process: integration_tests/test_dist_tp_cp.py."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain import nn
from blutrain import optim as bt_optim
from blutrain.dist import DistArgumentError, ProcessGroup, parallel_modes
from blutrain.models import GPT2, GPT2Config
from blutrain_parallel_tp import TP, Shard, TensorParallelModel, slice_shard, vocab_parallel_cross_entropy


def tiny() -> GPT2:
    bt.manual_seed(0)
    return GPT2(GPT2Config.preset("tiny", n_layer=2, n_head=4, n_embd=32, block_size=8))


def test_the_plugin_registers_tp() -> None:
    assert parallel_modes().get("tp") is TP


def test_slicing_by_heads_keeps_each_ranks_rows_of_q_k_and_v() -> None:
    full = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)  # q, k, v: 4 rows each
    got = slice_shard(bt.tensor(full), Shard(0, parts=3), rank=1, size=2).numpy()
    np.testing.assert_array_equal(got, full[[2, 3, 6, 7, 10, 11]])


def test_row_slicing_takes_columns() -> None:
    full = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    got = slice_shard(bt.tensor(full), Shard(1), rank=3, size=4).numpy()
    np.testing.assert_array_equal(got, full[:, 6:8])


def test_a_shape_that_does_not_split_is_an_error_naming_it() -> None:
    with pytest.raises(DistArgumentError, match=r"dim 0 of shape \[10, 2\] must split into 3 part\(s\) of 2"):
        slice_shard(bt.zeros(10, 2), Shard(0, parts=3), rank=0, size=2)


def test_the_rewritten_model_in_a_group_of_one_equals_gpt2(group_of_one: ProcessGroup) -> None:
    tokens = np.random.default_rng(0).integers(0, 256, (2, 9))
    x, y = bt.tensor(tokens[:, :-1]), bt.tensor(tokens[:, 1:])
    ref = tiny()
    ref_logits, ref_loss = ref(x, y)
    assert ref_loss is not None
    ref_loss.backward()
    model = tiny()
    tp = TP(group_of_one).wrap_model(model)
    assert isinstance(tp, TensorParallelModel)
    logits, loss = tp(x, y)
    assert loss is not None
    loss.backward()
    np.testing.assert_allclose(logits.detach().numpy(), ref_logits.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    full = tp.full_parameters()
    assert list(full) == [n for n, _ in ref.named_parameters()]


def test_vocab_parallel_cross_entropy_matches_float64_reference(group_of_one: ProcessGroup) -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 11)) * 4
    target = np.array([3, 0, -1, 10, 7])
    valid = target != -1
    lse = np.log(np.exp(logits).sum(1))
    want = (lse - logits[np.arange(5), np.where(valid, target, 0)])[valid].mean()
    probs = np.exp(logits - lse[:, None])
    probs[np.arange(5)[valid], target[valid]] -= 1
    x = bt.tensor(logits, dtype="float64", requires_grad=True)
    loss = vocab_parallel_cross_entropy(x, bt.tensor(target), group_of_one, 0, ignore_index=-1)
    loss.backward()
    assert x.grad is not None
    np.testing.assert_allclose(loss.item(), want, rtol=1e-13)
    np.testing.assert_allclose(x.grad.numpy(), probs * valid[:, None] / valid.sum(), atol=1e-14)


def test_vocab_parallel_cross_entropy_names_a_bad_target(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match=r"target must be an integer Tensor of shape \[4\].*got shape \[3\]"):
        vocab_parallel_cross_entropy(bt.zeros(4, 6), bt.tensor([1, 2, 3]), group_of_one, 0)


def test_wrapping_something_else_than_gpt2_is_an_error(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match=r"model must be a blutrain.models.Model with a parallel_plan .*, got "
                                                r"Linear"):
        TP(group_of_one).wrap_model(nn.Linear(2, 2))


@pytest.mark.parametrize(("shape", "shard", "size"), [((12, 2), Shard(0, parts=3), 2), ((3, 8), Shard(1), 4),
                                                     ((2, 6, 4), Shard(1, parts=3), 2), ((8,), Shard(0), 4)])
def test_a_shards_range_names_the_elements_of_its_block_in_its_order(shape: tuple[int, ...], shard: Shard,
                                                                     size: int) -> None:
    from blutrain.dist.sharded import range_blocks
    from blutrain_parallel_tp import full_shape, shard_range

    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    for rank in range(size):
        block = slice_shard(bt.tensor(full), shard, rank, size)
        assert full_shape(tuple(block.shape), shard, size) == shape
        spans = range_blocks(shard_range(shape, shard, rank, size))
        picked = np.concatenate([full.reshape(-1)[a:b] for a, b in spans])
        np.testing.assert_array_equal(picked, block.numpy().reshape(-1))


def test_async_chunks_must_be_a_positive_int(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match=r"TP: async_chunks must be an int >= 1 .* got -2"):
        TP(group_of_one, async_chunks=-2)


def trained_one_step(group_of_one: ProcessGroup, seed: int) -> tuple[TensorParallelModel, bt_optim.Optimizer]:
    tokens = np.random.default_rng(seed).integers(0, 256, (2, 9))
    bt.manual_seed(seed)
    tp = TP(group_of_one).wrap_model(GPT2(GPT2Config.preset("tiny", n_layer=2, n_head=4, n_embd=32, block_size=8)))
    optimizer = bt_optim.create("adamw", list(tp.module.parameters()), lr=1e-2)
    _, loss = tp(bt.tensor(tokens[:, :-1]), bt.tensor(tokens[:, 1:]))
    assert loss is not None
    loss.backward()
    optimizer.step()
    return tp, optimizer


def test_a_checkpoint_shard_merges_into_the_full_state_and_loads_back(group_of_one: ProcessGroup) -> None:
    from blutrain.dist import merge_shards

    tp, optimizer = trained_one_step(group_of_one, seed=2)
    model_state, optimizer_state = merge_shards([tp.checkpoint_shard(optimizer)])
    full = tp.full_state_dict()
    assert sorted(model_state) == sorted(full)
    for name, t in full.items():
        np.testing.assert_array_equal(model_state[name].numpy(), t.numpy(), err_msg=name)
    other, other_optimizer = trained_one_step(group_of_one, seed=3)  # other weights and moments, overwritten
    other.load_full_state_dict(model_state)
    other.load_full_optimizer_state_dict(other_optimizer, optimizer_state)
    for (name, p), q in zip(other.module.named_parameters(), tp.module.parameters(), strict=True):
        np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy(), err_msg=name)
    want = optimizer.state_dict()["state"]
    for i, entry in other_optimizer.state_dict()["state"].items():
        assert entry["step"] == want[i]["step"] == 1
        np.testing.assert_array_equal(entry["exp_avg"].numpy(), want[i]["exp_avg"].numpy())


def test_tp_declares_every_capability_the_trainer_reads() -> None:
    assert (TP.dim, TP.compiles, TP.on_mesh, TP.mesh_order, dict(TP.mesh_options)) == (
        "tp", True, True, 2, {"async": "async_chunks"})
    assert TP.shards_loss and TP.rewrites_layers and TP.shards_gradients and TP.shards_state
    assert not TP.splits_batch  # tp ranks read the same rows
    with pytest.raises(DistArgumentError, match="TP: async_chunks must be an int >= 1"):
        TP.check_options(async_chunks=-1)
    TP.check_options(async_chunks=0)  # synchronous


def test_the_modes_norm_and_state_are_its_wrapped_models(group_of_one: ProcessGroup) -> None:
    mode = TP(group_of_one)
    with pytest.raises(DistArgumentError, match=r"TP\.full_state_dict: call wrap_model first"):
        mode.full_state_dict()
    ref = tiny()
    model = mode.wrap_model(tiny())
    idx = bt.tensor(np.random.default_rng(0).integers(0, 256, (2, 8)))
    model(idx, idx)[1].backward()
    ref(idx, idx)[1].backward()
    whole = float(bt.norm(bt.stack([bt.norm(p.grad) for p in ref.parameters()])).item())
    np.testing.assert_allclose(float(mode.grad_norm().item()), whole, rtol=1e-5)
    np.testing.assert_allclose(float(mode.clip_grad_norm_(whole / 2).item()), whole, rtol=1e-5)
    np.testing.assert_allclose(float(mode.grad_norm().item()), whole / 2, rtol=1e-5)
    optimizer = bt_optim.create("adamw", model.module.parameters(), lr=1e-2)
    optimizer.step()
    state = mode.full_state_dict()
    assert set(state) == set(ref.state_dict())
    assert set(mode.state_shard(optimizer).params) == set(ref.state_dict())  # one rank holds every block
    other = TP(group_of_one)
    other.wrap_model(tiny())
    fresh = bt_optim.create("adamw", other.model.module.parameters(), lr=1e-2)  # type: ignore[union-attr]
    other.load_full_state(state, fresh, optimizer.state_dict())
    for name, t in other.full_state_dict().items():
        np.testing.assert_array_equal(t.numpy(), state[name].numpy(), err_msg=name)


def test_placements_name_each_rank_tensor_as_the_single_process_model_and_cut_it_from_it(
        group_of_one: ProcessGroup) -> None:
    from blutrain.dist import take_range

    whole = tiny().state_dict()
    model = TP(group_of_one).wrap_model(tiny())
    placed = model.placements()
    assert [p.name for p in placed] == list(whole)  # single-process names, in state_dict order
    local = model.module.state_dict(keep_vars=True)
    assert [id(p.tensor) for p in placed] == [id(t) for t in local.values()]  # the model's own tensors
    for p in placed:
        assert p.shape == tuple(whole[p.name].shape) and p.saved  # rank 0 saves the replicated ones too
        np.testing.assert_array_equal(take_range(whole[p.name], p.range).numpy(), p.tensor.detach().reshape(-1).numpy(),
                                      err_msg=p.name)
