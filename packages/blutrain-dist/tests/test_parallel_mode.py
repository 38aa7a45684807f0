"""ParallelMode: what the trainer may ask of any mode, each capability with the default of a mode that lacks it,
and the registry's refusal of a class that does not declare them."""

from __future__ import annotations

from typing import Any

import pytest

from blutrain.dist import ParallelMode, ParallelModeRegistry
from blutrain.tensor import PluginError


class Plain(ParallelMode):
    """A mode that only wraps: every capability keeps its default."""

    dim = "dp"

    def __init__(self, mesh: Any = None) -> None:
        self.group = mesh

    def wrap_model(self, model: Any) -> Any:
        return model


def test_a_mode_changes_nothing_it_does_not_declare() -> None:
    flags = ("compiles", "on_mesh", "splits_batch", "shards_loss", "rewrites_layers", "shards_gradients",
             "shards_state", "on_mesh_by_name", "nests_state")
    assert [getattr(Plain, flag) for flag in flags] == [False] * len(flags)
    assert Plain.mesh_order == 0 and dict(Plain.mesh_options) == {}
    assert Plain.sequence_multiple(8) == 1
    assert Plain().state_dims == ("dp",)  # a state-sharding mode's ranks differ along its own dimension
    Plain.check_options(1, 2, anything="goes")  # the default leaves options to the constructor


def test_the_defaults_return_the_optimizer_and_need_no_context() -> None:
    mode = Plain()
    optimizer = object()
    assert mode.wrap_optimizer(optimizer) is optimizer
    with mode.no_sync(), mode.gathered():
        pass


@pytest.mark.parametrize(("call", "flag"), [
    (lambda m: m.grad_norm(), "shards_gradients"),
    (lambda m: m.clip_grad_norm_(1.0), "shards_gradients"),
    (lambda m: m.state_shard(None), "shards_state"),
    (lambda m: m.full_state_dict(), "shards_state"),
    (lambda m: m.load_full_state({}, None, {}), "shards_state"),
    (lambda m: m.placements(), "shards_state"),
    (lambda m: m.nest(None, None), "nests_state"),
])
def test_a_capability_behind_a_flag_says_which_flag_it_belongs_to(call: Any, flag: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"^Plain\.\w+ is not implemented: a mode that sets {flag} = True"):
        call(Plain())


def test_a_mode_without_a_constructor_says_what_it_must_set() -> None:
    class NoInit(ParallelMode):
        dim = "dp"

    with pytest.raises(NotImplementedError, match="NoInit does not define __init__"):
        NoInit()


def test_the_registry_takes_subclasses_only() -> None:
    registry = ParallelModeRegistry()
    registry.register("plain", Plain)
    assert registry.get("plain") is Plain

    class Undeclared:
        dim = "dp"

        def wrap_model(self, model: Any) -> Any:
            return model

        def wrap_optimizer(self, optimizer: Any) -> Any:
            return optimizer

    with pytest.raises(PluginError, match=r"parallel mode 'undeclared' must be a subclass of "
                                          r"blutrain.dist.ParallelMode \(its declared capabilities\), got Undeclared"):
        registry.register("undeclared", Undeclared)  # type: ignore[arg-type]
