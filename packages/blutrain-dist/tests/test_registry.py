"""A parallel mode or comm backend of the project's that is not installed is named with its package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from blutrain.dist import comm_backends, parallel_modes
from blutrain.tensor import NotRegisteredError
from blutrain.tensor.testing import plugins_blocked


@pytest.fixture
def blocked() -> Iterator[None]:
    with plugins_blocked("ddp", "zero", "mpi"):
        yield


@pytest.mark.usefixtures("blocked")
@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_a_missing_parallel_mode_names_its_package(mode: str) -> None:
    with pytest.raises(NotRegisteredError, match=rf"no parallel mode '{mode}'; .*; install blutrain-parallel-{mode}$"):
        parallel_modes().get(mode)


@pytest.mark.usefixtures("blocked")
def test_a_missing_comm_backend_names_its_package() -> None:
    with pytest.raises(NotRegisteredError, match=r"no communication backend 'mpi'; .*; install blutrain-comm-mpi$"):
        comm_backends().get("mpi")


def test_a_name_no_project_plugin_has_gets_no_install_hint() -> None:
    with pytest.raises(NotRegisteredError) as caught:
        parallel_modes().get("fsdp9")
    assert "install" not in str(caught.value).split("installed:", 1)[1]


def test_a_devices_default_comm_backend_is_what_its_backend_declares() -> None:
    from blutrain.dist import DistArgumentError, default_comm_backend

    assert default_comm_backend("cpu") == "mpi"
    assert default_comm_backend("cpu:0") == "mpi"
    with pytest.raises(DistArgumentError, match="no device type 'tpu'"):
        default_comm_backend("tpu:3")
