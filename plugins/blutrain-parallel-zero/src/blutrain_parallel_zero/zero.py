"""The "zero" parallelism mode: ``ZeRO(mesh, stage)`` wraps the model, then the optimizer built over it."""

from __future__ import annotations

from typing import Any

from blutrain.dist import DeviceMesh, DistArgumentError, ProcessGroup, get_process_group
from blutrain_parallel_zero.model import DEFAULT_BUCKET_CAP_MB, STAGES, ZeroModel
from blutrain_parallel_zero.optimizer import ZeroOptimizer


class ZeRO:
    """ZeRO over the mesh's "dp" dimension (or a process group itself): ``stage`` 1 shards the
    optimizer state, 2 also the gradients, 3 also the parameters. Call :meth:`wrap_model` first, then
    :meth:`wrap_optimizer` with the optimizer built over the (unwrapped) model's parameters."""

    dim = "dp"
    compiles = True  # ZeroModel declares its group with blutrain.dist.traceable (see blutrain_parallel_zero.model)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, stage: int = 2,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        if isinstance(stage, bool) or stage not in STAGES:
            raise DistArgumentError(f"ZeRO: stage must be 1, 2 or 3, got {stage!r}")
        if isinstance(mesh, DeviceMesh):
            self.group = mesh.get_group(self.dim)
        else:
            self.group = get_process_group() if mesh is None else mesh
        self.stage = int(stage)
        self.bucket_cap_mb = bucket_cap_mb
        self.model: ZeroModel | None = None

    def wrap_model(self, model: Any) -> ZeroModel:
        if self.model is not None:
            raise DistArgumentError("ZeRO.wrap_model: this mode already wraps a model; build one ZeRO per model")
        self.model = ZeroModel(model, self.group, self.stage, self.bucket_cap_mb)
        return self.model

    def wrap_optimizer(self, optimizer: Any) -> ZeroOptimizer:
        if self.model is None:
            raise DistArgumentError("ZeRO.wrap_optimizer: call wrap_model first; the optimizer is sharded as the "
                                    "model's parameters are")
        return ZeroOptimizer(optimizer, self.model)


__all__ = ["ZeRO"]
