"""blutrain.tensor.testing: the README reader the documentation tests share, and the second host device."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import plugins
from blutrain.tensor.testing import PackageReadme, plugin_registered, plugins_blocked, second_host_device

README_TEXT = """# pkg

```python
value = 6 * 7
```

## Public API

- `listed`, `also_listed(x)`.

## Hooks

- `hooked`
"""


def _readme(tmp_path: Path, text: str) -> PackageReadme:
    (tmp_path / "tests").mkdir()
    (tmp_path / "README.md").write_text(text)
    return PackageReadme.of_tests(str(tmp_path / "tests" / "test_readme.py"))


def test_the_example_runs_in_a_fresh_namespace_that_is_returned(tmp_path: Path) -> None:
    assert _readme(tmp_path, README_TEXT).run_the_example()["value"] == 42


def test_run_the_example_refuses_a_readme_with_several_examples(tmp_path: Path) -> None:
    readme = _readme(tmp_path, README_TEXT + "```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="has 2 ```python examples, expected exactly one"):
        readme.run_the_example()


def test_unlisted_exports_names_only_what_the_public_api_section_lacks(tmp_path: Path) -> None:
    module = ModuleType("pkg")
    module.__all__ = ["listed", "also_listed", "hooked", "missing"]  # type: ignore[attr-defined]
    assert _readme(tmp_path, README_TEXT).unlisted_exports(module) == ["hooked", "missing"]


def test_a_readme_without_a_public_api_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="has no '## Public API' section"):
        _readme(tmp_path, "# pkg\n").unlisted_exports(ModuleType("pkg"))


def test_the_second_host_device_moves_tensors_and_is_gone_after_the_block() -> None:
    with second_host_device() as device:
        moved = bt.tensor([1.0, 2.0]).to(device) * 2
        assert moved.device is device
        assert moved.tolist() == [2.0, 4.0]
    with pytest.raises(bt.BluTrainError):
        bt.device("host2")


def test_a_blocked_plugin_is_gone_inside_the_block_and_back_after_it() -> None:
    assert "cpu-kernels" not in plugins.disabled_plugins()
    with plugins_blocked("cpu-kernels"):
        assert "cpu-kernels" in plugins.disabled_plugins()
        with pytest.raises(bt.KernelNotFoundError):
            bt.tensor([1.0]) + bt.tensor([2.0])
    assert "cpu-kernels" not in plugins.disabled_plugins()
    np.testing.assert_array_equal((bt.tensor([1.0]) + bt.tensor([2.0])).numpy(), [3.0])


class _Doubling:
    """Multiplication of float32 on cpu that adds one: wins the lookup only while it is registered."""

    @bt.hookimpl
    def blutrain_register_kernels(self, registry: bt.KernelRegistry) -> None:
        registry.register("mul", "cpu", "float32", lambda a, b: np.asarray(a * b + 1, dtype=np.float32),
                          priority=1000)


def test_a_registered_plugin_serves_inside_the_block_and_is_gone_after_it_even_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="inside"), plugin_registered(_Doubling(), "test-doubling"):
        assert (bt.ones(2) * 2).tolist() == [3.0, 3.0]
        raise RuntimeError("inside")
    assert (bt.ones(2) * 2).tolist() == [2.0, 2.0]
