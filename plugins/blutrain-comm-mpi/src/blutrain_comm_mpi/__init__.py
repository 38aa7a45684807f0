"""The "mpi" communication backend: BluTrain process groups on CPU tensors over mpi4py, registered
through ``blutrain_register_comm_backends``. MPI itself is imported when a group is created."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl
from blutrain_comm_mpi.group import MPIProcessGroup, MPIWork, create_group

if TYPE_CHECKING:
    from blutrain.dist import CommBackendRegistry


@hookimpl
def blutrain_register_comm_backends(registry: CommBackendRegistry) -> None:
    registry.register("mpi", create_group)


__all__ = ["MPIProcessGroup", "MPIWork", "blutrain_register_comm_backends", "create_group"]
