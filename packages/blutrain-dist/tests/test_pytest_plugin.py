"""The ``group_of_one`` fixture that blutrain-dist's pytest plugin declares for single-process tests."""

from __future__ import annotations

import blutrain.tensor as bt
from blutrain.dist import ProcessGroup, comm_backends, default_comm_backend


def test_group_of_one_is_rank_0_of_a_one_rank_group_of_the_hosts_backend(group_of_one: ProcessGroup) -> None:
    host_backend = default_comm_backend("cpu")
    assert (group_of_one.backend, group_of_one.rank, group_of_one.size) == (host_backend, 0, 1)
    assert host_backend in comm_backends()


def test_an_all_reduce_in_a_group_of_one_leaves_the_tensor_as_it_was(group_of_one: ProcessGroup) -> None:
    x = bt.tensor([1.5, -2.0, 3.0])
    group_of_one.all_reduce(x)
    assert x.tolist() == [1.5, -2.0, 3.0]
