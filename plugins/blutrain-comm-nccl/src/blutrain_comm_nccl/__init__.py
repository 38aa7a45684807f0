"""The "nccl" communication backend: BluTrain process groups on CUDA tensors over cupy.cuda.nccl,
registered through ``blutrain_register_comm_backends``. Importing it needs neither CuPy nor a GPU;
creating a group does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl
from blutrain_comm_nccl.group import NCCLProcessGroup, NCCLWork, create_group

if TYPE_CHECKING:
    from blutrain.dist import CommBackendRegistry


@hookimpl
def blutrain_register_comm_backends(registry: CommBackendRegistry) -> None:
    registry.register("nccl", create_group)


__all__ = ["NCCLProcessGroup", "NCCLWork", "blutrain_register_comm_backends", "create_group"]
