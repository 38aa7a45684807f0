"""A function whose trace holds work outside kernels handed to the capture (as a collective of a group declared
with ``blutrain.dist.traceable`` is): it is cut there into compiled parts, and every replay issues that work
between them on the real buffers — intermediates crossing the cut, views of them, state. In-place writes into
state are recorded like kernels. (Collectives of real process groups on several ranks:
integration_tests/test_dist_compile.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.compiler.split import SplitGraph
from blutrain.tensor import capture


def _scale(t: bt.Tensor, factor: float) -> None:
    with no_grad():
        t.mul_(factor)


def scale_outside_kernels(t: bt.Tensor, factor: float) -> None:
    """``t *= factor`` as a collective does its work: handed to the capture when one is active."""
    found = capture.active()
    if found is None:
        _scale(t, factor)
    else:
        found.host_call("scale", _scale, (t, factor))


def _calls(fn: Any, inputs: list[bt.Tensor]) -> list[np.ndarray[Any, Any]]:
    return [fn(x).numpy().copy() for x in inputs]


INPUTS = [bt.tensor([1.0, 2.0, 3.0, 4.0]) * float(i + 1) for i in range(4)]


def test_an_intermediate_crosses_the_cut_and_the_replay_issues_the_work_on_it() -> None:
    def f(x: bt.Tensor) -> bt.Tensor:
        y = x * 2.0
        scale_outside_kernels(y, 3.0)
        return y + 1.0

    fn = bc.compile(f)
    got = _calls(fn, INPUTS)
    for x, g in zip(INPUTS, got, strict=True):
        np.testing.assert_array_equal(g, x.numpy() * 6.0 + 1.0)
    graph = fn.last
    assert isinstance(graph, SplitGraph) and len(graph.parts) == 2 and graph.collectives == 1
    assert fn.traces == 1
    assert "// part 0" in fn.ir() and "// part 1" in fn.ir() and "// collective scale on %" in fn.ir()


def test_a_view_made_before_the_cut_is_made_again_after_it() -> None:
    def f(x: bt.Tensor) -> bt.Tensor:
        y = x * 1.0
        tail = y[1:]
        scale_outside_kernels(y, 10.0)
        return tail * 1.0

    got = _calls(bc.compile(f), INPUTS)
    for x, g in zip(INPUTS, got, strict=True):
        np.testing.assert_array_equal(g, x.numpy()[1:] * 10.0)


def test_state_written_outside_kernels_keeps_its_updates_across_calls() -> None:
    acc = bt.zeros(4)

    def f(x: bt.Tensor) -> bt.Tensor:
        acc.add_(x)  # an in-place write into memory that outlives the call: recorded like a kernel
        scale_outside_kernels(acc, 0.5)
        return acc * 1.0

    fn = bc.compile(f)
    expected = np.zeros(4, np.float32)
    for x in INPUTS:
        expected = (expected + x.numpy()) * 0.5
        np.testing.assert_array_equal(fn(x).numpy(), expected)
    np.testing.assert_array_equal(acc.numpy(), expected)
    assert fn.traces == 1 and isinstance(fn.last, SplitGraph)


def test_an_in_place_write_into_state_replays_without_a_cut() -> None:
    total = bt.zeros(4)

    def f(x: bt.Tensor) -> bt.Tensor:
        total.add_(x)
        return total * 2.0

    fn = bc.compile(f)
    for k in range(1, 5):
        np.testing.assert_array_equal(fn(bt.ones(4)).numpy(), np.full(4, 2.0 * k, np.float32))
    assert not isinstance(fn.last, SplitGraph)


def test_work_outside_kernels_with_other_arguments_than_traced_is_a_graph_break() -> None:
    factors = iter([2.0, 2.0, 3.0])

    def f(x: bt.Tensor) -> bt.Tensor:
        y = x * 1.0
        scale_outside_kernels(y, next(factors))
        return y

    fn = bc.compile(f, replay="probe")
    fn(INPUTS[0])
    fn(INPUTS[0])
    with pytest.raises(bc.GraphBreakError, match="scale of this call has arguments"):
        fn(INPUTS[0])


def test_a_capture_refuses_work_that_was_not_handed_to_it_with_the_callers_line() -> None:
    def f(x: bt.Tensor) -> bt.Tensor:
        found = capture.active()
        assert found is not None
        found.refuse("the collective all_reduce")  # what a plain process group's collective does
        return x

    with pytest.raises(bc.TracingError, match=r"test_split\.py:\d+: .*found\.refuse.*\n.*the collective all_reduce "
                                              "was called while blutrain.compiler traces"):
        bc.compile(f, warmup=0)(INPUTS[0])


def test_a_buffer_in_a_permuted_layout_crosses_the_cut_with_its_layout() -> None:
    """A kernel may leave a dense buffer in another order than C (a cat of transposed pieces is laid out as
    they are); views after the cut address its memory as traced, so it must cross in that layout."""
    def f(x: bt.Tensor) -> bt.Tensor:
        y = (x * 2.0).t()
        z = bt.cat([y.unsqueeze(0), (y + 1.0).unsqueeze(0)], dim=0)  # (2, 3, 4), not C-ordered
        scale_outside_kernels(x * 1.0, 1.0)  # a cut between z and its views
        return z[1] * 10.0 + z[0].sum(0)

    inputs = [bt.tensor(np.arange(12.0, dtype=np.float32).reshape(4, 3) * (i + 1)) for i in range(4)]
    fn = bc.compile(f)
    for x in inputs:
        want = f(x).numpy()
        np.testing.assert_array_equal(fn(x).numpy(), want)
    assert isinstance(fn.last, SplitGraph)
