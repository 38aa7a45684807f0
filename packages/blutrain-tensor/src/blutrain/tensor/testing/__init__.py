"""Test helpers for the packages and plugins built on blutrain.tensor: what their test suites would otherwise each
write again. ``PackageReadme`` reads a package's README as its documentation tests do (the Python examples, the names
of the "Public API" section); ``second_host_device`` registers a second NumPy device for the tests that move tensors
between devices; ``plugin_registered`` registers a test's plugin for a ``with`` block, and ``plugins_blocked``
reloads the plugins with some blocked, as where they are not installed.
Nothing here needs pytest: a test suite wraps them in its own fixtures and asserts."""

from blutrain.tensor.testing.devices import second_host_device
from blutrain.tensor.testing.plugins import plugin_registered, plugins_blocked
from blutrain.tensor.testing.readme import PackageReadme

__all__ = ["PackageReadme", "plugin_registered", "plugins_blocked", "second_host_device"]
