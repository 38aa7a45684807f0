"""Views share storage with their base, in-place writes bump the shared version counter."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.tensor as bt
from blutrain.tensor import ShapeError, Tensor, TensorValueError


def grid(*shape: int) -> Tensor:
    return bt.arange(int(np.prod(shape)), dtype="float32").reshape(shape)


VIEWS: dict[str, Callable[[Tensor], Tensor]] = {
    "view": lambda x: x.view(4, 6),
    "reshape (contiguous)": lambda x: x.reshape(-1),
    "flatten": lambda x: x.flatten(1),
    "unflatten": lambda x: x.unflatten(2, (2, 2)),
    "transpose": lambda x: x.transpose(0, 2),
    "permute": lambda x: x.permute(2, 0, 1),
    "t": lambda x: x[0].t(),
    "T": lambda x: x.T,
    "mT": lambda x: x.mT,
    "movedim": lambda x: x.movedim(0, -1),
    "slice with step": lambda x: x[:, ::2, 1:],
    "integer index": lambda x: x[1],
    "full integer index": lambda x: x[1, 2, 3],
    "None and Ellipsis": lambda x: x[None, ..., 0],
    "narrow": lambda x: x.narrow(1, 1, 2),
    "select": lambda x: x.select(2, 3),
    "expand": lambda x: x[:, :1].expand(2, 5, 4),
    "broadcast_to": lambda x: x[:1].broadcast_to(3, 3, 4),
    "squeeze": lambda x: x[:, :1].squeeze(1),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "split": lambda x: x.split(2, dim=1)[1],
    "chunk": lambda x: x.chunk(2, dim=2)[1],
    "unbind": lambda x: x.unbind(1)[2],
    "detach": lambda x: x.detach(),
}


@pytest.mark.parametrize("make", VIEWS.values(), ids=VIEWS.keys())
def test_a_view_shares_storage_and_version_with_its_base(make: Callable[[Tensor], Tensor]) -> None:
    base = grid(2, 3, 4)
    view = make(base)
    np.testing.assert_array_equal(view.numpy(), make(grid(2, 3, 4)).numpy())
    assert view.storage is base.storage
    assert np.shares_memory(view.numpy(), base.numpy())
    base.add_(1)
    assert view.version == base.version == 1
    np.testing.assert_array_equal(view.numpy(), make(grid(2, 3, 4) + 1).numpy())


def test_writing_through_a_view_changes_the_base_and_bumps_the_shared_version() -> None:
    base = grid(3, 4)
    column = base[:, 1]
    column.mul_(-1)
    assert base.version == 1
    np.testing.assert_array_equal(base.numpy()[:, 1], [-1, -5, -9])


def test_reshape_copies_only_when_the_strides_force_it() -> None:
    x = grid(3, 4)
    assert x.reshape(12).storage is x.storage
    transposed = x.t()
    flat = transposed.reshape(12)
    assert flat.storage is not x.storage
    np.testing.assert_array_equal(flat.numpy(), x.numpy().T.reshape(12))


def test_view_of_a_compatible_non_contiguous_tensor_needs_no_copy() -> None:
    x = grid(4, 6)[:, ::2]  # strides (6, 2): the last two dims can be split, not merged
    v = x.view(4, 3, 1)
    assert v.storage is x.storage
    np.testing.assert_array_equal(v.numpy(), x.numpy().reshape(4, 3, 1))


def test_view_that_would_need_a_copy_raises_and_points_to_reshape() -> None:
    with pytest.raises(ShapeError, match=r"view: shape \[6\] is not compatible with the strides \[1, 3\].*reshape"):
        grid(2, 3).t().view(6)


@settings(max_examples=40, deadline=None, database=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_view_succeeds_exactly_when_numpy_can_reshape_without_copying(shape: list[int], data: st.DataObject) -> None:
    x = grid(*shape)
    perm = data.draw(st.permutations(range(len(shape))))
    y = x.permute(*perm)
    sizes = [s for s in y.shape]
    target = data.draw(st.sampled_from([(-1,), (*sizes[:1], -1), tuple(reversed(sizes)), (1, *sizes, 1)]))
    as_numpy = y.numpy().view()
    try:
        as_numpy.shape = target  # NumPy's own no-copy rule
        numpy_can = True
    except AttributeError:
        numpy_can = False
    if numpy_can:
        v = y.view(target)
        assert v.storage is x.storage
        np.testing.assert_array_equal(v.numpy(), as_numpy)
    else:
        with pytest.raises(ShapeError):
            y.view(target)


def test_strides_and_storage_offset_are_in_elements() -> None:
    x = bt.zeros(4, 6, dtype="float64")
    v = x[1:, 2::2]
    assert v.stride() == (6, 2)
    assert v.stride(1) == 2
    assert v.storage_offset() == 8
    assert v.data_ptr() == x.data_ptr() + 8 * 8


def test_contiguous_returns_self_when_already_contiguous_and_a_copy_otherwise() -> None:
    x = grid(2, 3)
    assert x.is_contiguous() and x.contiguous() is x
    t = x.t()
    assert not t.is_contiguous()
    c = t.contiguous()
    assert c.is_contiguous() and c.storage is not x.storage
    np.testing.assert_array_equal(c.numpy(), x.numpy().T)


def test_assigning_data_keeps_identity_and_autograd_state() -> None:
    p = bt.ones(2, requires_grad=True)
    calls = []
    p.register_post_accumulate_grad_hook(lambda t: calls.append(t))
    p.data = bt.zeros(3, dtype="float64")
    assert p.requires_grad and p.shape == (3,) and p.dtype is bt.float64
    (p * 2).sum().backward()
    assert calls == [p]


def test_clone_copies_the_storage() -> None:
    x = grid(2, 3)
    c = x.clone()
    c.add_(1)
    assert x.version == 0
    np.testing.assert_array_equal(x.numpy(), grid(2, 3).numpy())


INPLACE: dict[str, Callable[[Tensor], object]] = {
    "add_": lambda x: x.add_(1),
    "sub_": lambda x: x.sub_(1, alpha=2),
    "mul_": lambda x: x.mul_(2),
    "div_": lambda x: x.div_(2),
    "pow_": lambda x: x.pow_(2),
    "+=": lambda x: x.__iadd__(1),
    "*=": lambda x: x.__imul__(2),
    "zero_": lambda x: x.zero_(),
    "fill_": lambda x: x.fill_(3.0),
    "copy_": lambda x: x.copy_(bt.ones(4)),
    "clamp_": lambda x: x.clamp_(0, 1),
    "masked_fill_": lambda x: x.masked_fill_(x > 1, 0.0),
    "setitem": lambda x: x.__setitem__(slice(0, 2), 7.0),
    "index_put_": lambda x: bt.index_put_(x, (bt.tensor([0, 0]),), bt.ones(2), accumulate=True),
    "uniform_": lambda x: x.uniform_(),
    "normal_": lambda x: x.normal_(),
}


@pytest.mark.parametrize("op", INPLACE.values(), ids=INPLACE.keys())
def test_every_in_place_op_bumps_the_version_of_the_storage(op: Callable[[Tensor], object]) -> None:
    base = bt.arange(8, dtype="float32")
    view = base[::2]
    op(view)
    assert view.version == 1 and base.version == 1


def test_in_place_ops_return_the_tensor_itself() -> None:
    x = bt.ones(3)
    assert x.add_(1) is x and x.mul_(2) is x and x.zero_() is x


def test_writing_into_an_expanded_view_is_refused() -> None:
    x = bt.zeros(1, 3).expand(2, 3)
    with pytest.raises(TensorValueError, match=r"add_: the target of shape \[2, 3\] and strides \[0, 1\]"):
        x.add_(1)


def test_split_and_chunk_cover_the_dim_with_a_short_last_piece() -> None:
    x = bt.arange(7)
    assert [p.shape for p in x.split(3)] == [(3,), (3,), (1,)]
    assert [p.shape for p in x.split([2, 5])] == [(2,), (5,)]
    assert [p.shape for p in x.chunk(3)] == [(3,), (3,), (1,)]


def test_expand_keeps_sizes_given_as_minus_one() -> None:
    x = bt.ones(3, 1)
    assert x.expand(-1, 4).shape == (3, 4)
    assert x.expand(2, -1, 4).shape == (2, 3, 4)
    assert x.expand(2, -1, 4).stride() == (0, 1, 0)
