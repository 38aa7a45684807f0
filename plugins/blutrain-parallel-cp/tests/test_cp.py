"""Context parallelism in one process (an MPI singleton): the chunk layout, each attention kind on a GPT-2
equal to the plain one, and argument errors. The attentions themselves: test_attention.py; multi-rank
runs: integration_tests/test_dist_tp_cp.py."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.dist import DistArgumentError, ProcessGroup, parallel_modes
from blutrain.models import GPT2, GPT2Config
from blutrain_parallel_cp import CP, ChunkLayout, ContextParallelModel


def tiny() -> GPT2:
    bt.manual_seed(0)
    return GPT2(GPT2Config.preset("tiny", n_layer=2, n_head=4, n_embd=32, block_size=8))


def test_the_plugin_registers_cp() -> None:
    assert parallel_modes().get("cp") is CP


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    layout = ChunkLayout(12, 3)
    assert [layout.chunks(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert layout.positions(1) == [2, 3, 8, 9]
    gathered = [p for r in range(3) for p in layout.positions(r)]
    assert [gathered[i] for i in layout.order()] == list(range(12))
    x = bt.tensor(np.arange(24).reshape(2, 12))
    assert layout.shard(x, 2).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_gathered_sequence_is_put_in_natural_order_and_back_by_slices(world: int) -> None:
    layout = ChunkLayout(4 * world, world)
    gathered = np.array([p for r in range(world) for p in layout.positions(r)])
    x = bt.tensor(np.stack([gathered, gathered * 10]))  # (2, T): dim 1 in every rank's local order in turn
    natural = layout.to_natural(x, 1)
    assert natural.tolist() == [list(range(4 * world)), [10 * p for p in range(4 * world)]]
    assert natural.tolist() == x.index_select(1, bt.tensor(layout.order())).tolist()
    assert layout.from_natural(natural, 1).tolist() == x.tolist()
    assert layout.position_ids(world - 1).tolist() == layout.positions(world - 1)


def test_a_sequence_that_does_not_split_in_two_chunks_per_rank_is_an_error() -> None:
    with pytest.raises(DistArgumentError, match=r"sequence length 10 must be a multiple of 2·cp = 4"):
        ChunkLayout(10, 2)


@pytest.mark.parametrize("attn", ["ring", "allgather", "ulysses"])
def test_each_attention_in_a_group_of_one_equals_gpt2(group_of_one: ProcessGroup, attn: str) -> None:
    tokens = np.random.default_rng(0).integers(0, 256, (2, 9))
    x, y = bt.tensor(tokens[:, :-1]), bt.tensor(tokens[:, 1:])
    ref = tiny()
    _, ref_loss = ref(x, y)
    assert ref_loss is not None
    ref_loss.backward()
    model = tiny()
    _, loss = CP(group_of_one, attn=attn).wrap_model(model)(x, y)
    assert loss is not None
    loss.backward()
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_unknown_attention_is_an_error_naming_the_choices(group_of_one: ProcessGroup) -> None:
    with pytest.raises(DistArgumentError, match="attn must be one of ring, allgather, ulysses, got 'flash'"):
        CP(group_of_one, attn="flash")


def test_a_sequence_length_that_does_not_split_is_named_at_forward(group_of_one: ProcessGroup) -> None:
    model = ContextParallelModel(tiny(), group_of_one)
    with pytest.raises(DistArgumentError, match="sequence length 7 must be a multiple of 2·cp = 2"):
        model(bt.zeros(1, 7, dtype="int64"))


def test_cp_declares_its_own_loss_rewritten_layers_and_whole_state() -> None:
    assert (CP.dim, CP.compiles, CP.on_mesh, CP.mesh_order, dict(CP.mesh_options)) == (
        "cp", True, True, 1, {"attn": "attn"})
    assert CP.shards_loss and CP.rewrites_layers
    assert not (CP.shards_gradients or CP.shards_state)
    assert not CP.splits_batch  # cp ranks read the same rows (each its part of the sequence)
    assert CP.sequence_multiple(4) == 8  # two chunks of every sequence per rank
    with pytest.raises(DistArgumentError, match="CP: attn must be one of ring, allgather, ulysses, got 'star'"):
        CP.check_options(attn="star")

