"""The copy-elision pass: a clone of a GEMM's product that nothing else reads is dropped and its readers (an
in-place write included) read the product; every other clone stays; compiled results against eager."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body


def _names(fn: Any, *arrays: np.ndarray) -> list[str]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, ["copy-elision"])
    return [o.name for o in body(module).ops]


def _arrays(seed: int, rows: int = 6, c_in: int = 5, c_out: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, c_in)).astype(np.float32), rng.standard_normal((c_out, c_in)).astype(np.float32)]


def written_clone(x: bt.Tensor, w: bt.Tensor) -> bt.Tensor:
    """What tensor parallelism does before an all-reduce: clone the product, then write the clone in place."""
    y = bt.linear(x, w).clone()
    y.mul_(3.0)
    return y + 1.0


def test_a_clone_of_a_product_read_by_nothing_else_is_dropped() -> None:
    names = _names(written_clone, *_arrays(0))
    assert "blutrain.copy" not in names and "blutrain.linear" in names


def test_clones_that_must_stay_stay() -> None:
    def read_twice(x: bt.Tensor, w: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        y = bt.linear(x, w)
        z = y.clone()
        z.mul_(3.0)
        return z, y + 1.0  # y has a second reader: writing it in place would change this sum

    def of_an_input(x: bt.Tensor, w: bt.Tensor) -> bt.Tensor:
        z = x.clone()  # the caller's array: never written
        z.mul_(3.0)
        return z

    def of_a_view(x: bt.Tensor, w: bt.Tensor) -> bt.Tensor:
        return bt.linear(x, w).t().clone()  # a transposed view: its clone has another layout

    def of_another_op(x: bt.Tensor, w: bt.Tensor) -> bt.Tensor:
        z = (x * 2.0).clone()  # not a GEMM's product: its layout is not known to be the copy's
        z.mul_(3.0)
        return z

    for fn in (read_twice, of_an_input, of_a_view, of_another_op):
        assert "blutrain.copy" in _names(fn, *_arrays(1)), fn.__name__


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 7), st.integers(1, 6), st.integers(0, 2**16))
def test_compiled_with_the_clone_dropped_gives_eager_results_bit_for_bit(rows: int, c_in: int, c_out: int,
                                                                         seed: int) -> None:
    x, w = _arrays(seed, rows, c_in, c_out)
    eager = written_clone(bt.from_numpy(x), bt.from_numpy(w)).numpy()
    step = bc.compile(written_clone)
    for _ in range(3):  # eager, trace, replay
        got = step(bt.from_numpy(x), bt.from_numpy(w)).numpy()
        np.testing.assert_array_equal(got, eager)
    assert "blutrain.copy" not in step.ir()
