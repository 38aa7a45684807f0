"""Grad modes: no_grad, enable_grad and set_grad_enabled as context managers, decorators, functions."""

from __future__ import annotations

import threading

import blutrain.tensor as bt
from blutrain.autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled


def leaf() -> bt.Tensor:
    return bt.tensor([1.0, 2.0], requires_grad=True)


def test_no_grad_records_nothing_inside_and_restores_the_mode() -> None:
    x = leaf()
    with no_grad():
        y = x * 2
        assert not is_grad_enabled()
    assert is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None


def test_no_grad_restores_the_mode_when_the_block_raises() -> None:
    try:
        with no_grad():
            raise KeyError("boom")
    except KeyError:
        pass
    assert is_grad_enabled()


def test_enable_grad_records_inside_no_grad() -> None:
    x = leaf()
    with no_grad(), enable_grad():
        y = x * 2
    assert y.requires_grad


def test_no_grad_decorates_with_and_without_parentheses() -> None:
    @no_grad()
    def with_parens(t: bt.Tensor) -> bt.Tensor:
        return t * 2

    @no_grad
    def bare(t: bt.Tensor) -> bt.Tensor:
        return t * 2

    assert not with_parens(leaf()).requires_grad
    assert not bare(leaf()).requires_grad
    assert bare.__name__ == "bare"
    assert is_grad_enabled()


def test_enable_grad_decorates_bare() -> None:
    @enable_grad
    def f(t: bt.Tensor) -> bt.Tensor:
        return t * 2

    with no_grad():
        assert f(leaf()).requires_grad


def test_set_grad_enabled_as_a_function_takes_effect_at_once() -> None:
    set_grad_enabled(False)
    try:
        assert not is_grad_enabled()
        assert not (leaf() * 2).requires_grad
    finally:
        set_grad_enabled(True)
    assert is_grad_enabled()


def test_set_grad_enabled_as_a_context_manager_restores_the_mode() -> None:
    with set_grad_enabled(False):
        assert not is_grad_enabled()
    assert is_grad_enabled()
    with no_grad():
        with set_grad_enabled(True):
            assert is_grad_enabled()
        assert not is_grad_enabled()


def test_set_grad_enabled_as_a_decorator_changes_the_mode_only_inside() -> None:
    @set_grad_enabled(False)
    def f(t: bt.Tensor) -> bt.Tensor:
        return t * 2

    assert is_grad_enabled()
    assert not f(leaf()).requires_grad
    assert is_grad_enabled()


def test_grad_mode_is_per_thread() -> None:
    seen = []
    with no_grad():
        worker = threading.Thread(target=lambda: seen.append(is_grad_enabled()))
        worker.start()
        worker.join()
    assert seen == [True]
