"""blutrain.dist.before_destroy: what holds a CUDA graph of a group's collectives releases it before the group is
destroyed (NCCL's communicator destroy waits for such graphs), without being kept alive by registering."""

from __future__ import annotations

import gc

from blutrain.dist import before_destroy, destroy_process_group


class Holder:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def release(self) -> None:
        self.calls.append(self.name)


def test_callbacks_run_once_in_order_before_the_next_destroy() -> None:
    calls: list[str] = []
    a, b = Holder(calls, "a"), Holder(calls, "b")
    before_destroy(a.release)
    before_destroy(b.release)
    destroy_process_group()
    assert calls == ["a", "b"]
    destroy_process_group()  # run once: a second destroy calls nothing
    assert calls == ["a", "b"]


def test_a_registered_bound_method_does_not_keep_its_object_alive() -> None:
    calls: list[str] = []
    holder = Holder(calls, "gone")
    before_destroy(holder.release)
    del holder
    gc.collect()
    destroy_process_group()
    assert calls == []


def test_a_plain_function_is_called() -> None:
    calls: list[str] = []

    def release() -> None:
        calls.append("fn")

    before_destroy(release)
    destroy_process_group()
    assert calls == ["fn"]
