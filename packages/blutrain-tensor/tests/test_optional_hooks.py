"""A plugin may implement a hook of a package that is not installed only by saying so: ``optionalhook=True``.
An unmarked implementation of a hook no installed package defines is a misspelling, refused naming it."""

from __future__ import annotations

import pytest

from blutrain.tensor import plugins
from blutrain.tensor.errors import PluginError
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered


class _Optional:
    @hookimpl(optionalhook=True)
    def blutrain_register_widgets(self, registry: object) -> None:  # no installed package defines it
        raise AssertionError("never called: no package asks for widgets")


class _Unmarked:
    @hookimpl
    def blutrain_register_widgets(self, registry: object) -> None:
        raise AssertionError("never called")


def test_an_optional_hook_of_no_installed_package_is_accepted() -> None:
    with plugin_registered(_Optional(), "optional-widgets"):
        assert "optional-widgets" in {info.name for info in plugins.plugin_infos()}


def test_the_same_hook_unmarked_is_refused_as_a_misspelling() -> None:
    with pytest.raises(PluginError, match="implements unknown hook 'blutrain_register_widgets'"):
        plugins.register(_Unmarked(), "unmarked-widgets")
    plugins.unregister("unmarked-widgets")
