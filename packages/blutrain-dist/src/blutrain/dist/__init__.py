"""blutrain.dist: distributed execution. This release defines the hook specifications and registries
that communication-backend and parallelism-mode plugins fill; the process groups, launcher and modes
land with the distributed issue."""

from blutrain.dist.registry import CommBackendRegistry, ParallelModeRegistry, comm_backends, parallel_modes

__all__ = ["CommBackendRegistry", "ParallelModeRegistry", "comm_backends", "parallel_modes"]
