"""A function whose trace holds work outside kernels handed to the capture (as a collective of a group declared
with ``blutrain.dist.traceable`` is): it compiles as one module in which that work is a ``blutrain.collective`` op,
and every replay issues it at its place on the real buffers — intermediates, views of them, state. The program
joins each collective at the first later launch that touches its buffers. In-place writes into state are
recorded like kernels. (Collectives of real process groups on several ranks: integration_tests/test_dist_compile.py;
on CUDA the same program forks each collective onto a communication stream: test_cuda_collectives.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.compiler.executor import Program
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


def _program(fn: bc.CompiledFunction) -> Program:
    graph = fn.last
    assert graph is not None
    return graph.program


def test_the_work_is_an_op_of_the_one_module_and_the_replay_issues_it_on_an_intermediate() -> None:
    def f(x: bt.Tensor) -> bt.Tensor:
        y = x * 2.0
        scale_outside_kernels(y, 3.0)
        return y + 1.0

    fn = bc.compile(f)
    got = _calls(fn, INPUTS)
    for x, g in zip(INPUTS, got, strict=True):
        np.testing.assert_array_equal(g, x.numpy() * 6.0 + 1.0)
    assert fn.traces == 1 and fn.stats.collectives == 1
    assert fn.ir().count('"blutrain.collective"') == 1 and 'what = "scale"' in fn.ir()
    kinds = [launch.kind for launch in _program(fn).launches]
    assert kinds.count("collective") == 1


def test_the_first_later_launch_that_touches_the_buffer_joins_the_collective() -> None:
    def f(x: bt.Tensor) -> bt.Tensor:
        y = x * 2.0
        z = x + 5.0  # independent of y: may run beside the collective
        scale_outside_kernels(y, 3.0)
        w = z * 4.0  # still independent
        return y * w  # reads y: joins the collective

    fn = bc.compile(f, passes=["inplace-aliasing", "kernel-selection"])  # no fusion: one launch per op
    for x in INPUTS:
        np.testing.assert_array_equal(fn(x).numpy(), (x.numpy() * 6.0) * ((x.numpy() + 5.0) * 4.0))
    launches = _program(fn).launches
    at = next(i for i, launch in enumerate(launches) if launch.kind == "collective")
    joined = [i for i, launch in enumerate(launches) if at in launch.joins]
    assert len(joined) == 1 and joined[0] > at + 1  # the independent multiply ran in between
    assert launches[at + 1].kind == "kernel" and not launches[at + 1].joins
    assert _program(fn).final_joins == []


def test_a_collective_nothing_later_touches_is_joined_at_the_end() -> None:
    acc = bt.zeros(4)

    def f(x: bt.Tensor) -> bt.Tensor:
        out = x * 3.0
        scale_outside_kernels(acc, 2.0)  # state that no later op of the step reads
        return out

    fn = bc.compile(f)
    for x in INPUTS:
        np.testing.assert_array_equal(fn(x).numpy(), x.numpy() * 3.0)
    program = _program(fn)
    at = next(i for i, launch in enumerate(program.launches) if launch.kind == "collective")
    assert program.final_joins == [at]


def test_a_view_made_before_the_collective_reads_its_result() -> None:
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
    assert fn.traces == 1 and fn.stats.collectives == 1


def test_an_in_place_write_into_state_replays_as_a_kernel() -> None:
    total = bt.zeros(4)

    def f(x: bt.Tensor) -> bt.Tensor:
        total.add_(x)
        return total * 2.0

    fn = bc.compile(f)
    for k in range(1, 5):
        np.testing.assert_array_equal(fn(bt.ones(4)).numpy(), np.full(4, 2.0 * k, np.float32))
    assert fn.stats.collectives == 0


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

    with pytest.raises(bc.TracingError, match=r"test_collective_ops\.py:\d+: .*found\.refuse.*\n.*the collective "
                                              "all_reduce was called while blutrain.compiler traces"):
        bc.compile(f, warmup=0)(INPUTS[0])


def test_views_of_a_buffer_in_a_permuted_layout_after_a_collective_address_it_as_traced() -> None:
    """A kernel may leave a dense buffer in another order than C (a cat of transposed pieces is laid out as
    they are); views after the collective address its memory as traced."""
    def f(x: bt.Tensor) -> bt.Tensor:
        y = (x * 2.0).t()
        z = bt.cat([y.unsqueeze(0), (y + 1.0).unsqueeze(0)], dim=0)  # (2, 3, 4), not C-ordered
        scale_outside_kernels(x * 1.0, 1.0)  # a collective between z and its views
        return z[1] * 10.0 + z[0].sum(0)

    inputs = [bt.tensor(np.arange(12.0, dtype=np.float32).reshape(4, 3) * (i + 1)) for i in range(4)]
    fn = bc.compile(f)
    for x in inputs:
        want = f(x).numpy()
        np.testing.assert_array_equal(fn(x).numpy(), want)
    assert fn.stats.collectives == 1
