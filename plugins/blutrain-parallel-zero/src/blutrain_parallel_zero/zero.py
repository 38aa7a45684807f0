"""The "zero" parallelism mode: ``ZeRO(mesh, stage)`` wraps the model, then the optimizer built over it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from blutrain.dist import DeviceMesh, DistArgumentError, ParallelMode, ProcessGroup, StateShard, get_process_group
from blutrain.tensor import Tensor
from blutrain_parallel_zero.model import DEFAULT_BUCKET_CAP_MB, STAGES, ZeroModel
from blutrain_parallel_zero.optimizer import ZeroOptimizer


class ZeRO(ParallelMode):
    """ZeRO over the mesh's "dp" dimension (or a process group itself): ``stage`` 1 shards the
    optimizer state, 2 also the gradients, 3 also the parameters. Call :meth:`wrap_model` first, then
    :meth:`wrap_optimizer` with the optimizer built over the (unwrapped) model's parameters.

    Every stage keeps a shard of the gradient's reduction on each rank and a shard of the optimizer state,
    so the global gradient norm and checkpoints go through the mode (``shards_gradients``, ``shards_state``).
    ZeRO runs alone over every rank (it knows no tp or cp group): it is not the mesh form's "dp" mode."""

    dim = "dp"
    splits_batch = True  # each replica trains on its own rows of the batch
    compiles = True  # ZeroModel declares its group with blutrain.dist.traceable (see blutrain_parallel_zero.model)
    shards_gradients = True
    shards_state = True

    @classmethod
    def check_options(cls, stage: int = 2, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        if isinstance(stage, bool) or stage not in STAGES:
            raise DistArgumentError(f"ZeRO: stage must be 1, 2 or 3, got {stage!r}")

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, stage: int = 2,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        self.check_options(stage, bucket_cap_mb)
        if isinstance(mesh, DeviceMesh):
            self.group = mesh.get_group(self.dim)
        else:
            self.group = get_process_group() if mesh is None else mesh
        self.stage = int(stage)
        self.bucket_cap_mb = bucket_cap_mb
        self.model: ZeroModel | None = None
        self.optimizer: ZeroOptimizer | None = None

    def wrap_model(self, model: Any) -> ZeroModel:
        if self.model is not None:
            raise DistArgumentError("ZeRO.wrap_model: this mode already wraps a model; build one ZeRO per model")
        self.model = ZeroModel(model, self.group, self.stage, self.bucket_cap_mb)
        return self.model

    def wrap_optimizer(self, optimizer: Any) -> ZeroOptimizer:
        if self.model is None:
            raise DistArgumentError("ZeRO.wrap_optimizer: call wrap_model first; the optimizer is sharded as the "
                                    "model's parameters are")
        self.optimizer = ZeroOptimizer(optimizer, self.model)
        return self.optimizer

    def _wrapped(self, method: str) -> tuple[ZeroModel, ZeroOptimizer]:
        if self.model is None or self.optimizer is None:
            raise DistArgumentError(f"ZeRO.{method}: call wrap_model and wrap_optimizer first")
        return self.model, self.optimizer

    def gathered(self) -> AbstractContextManager[None]:
        return self.model.gathered() if self.model is not None else nullcontext()

    def grad_norm(self) -> Tensor:
        return self._wrapped("grad_norm")[1].grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        return self._wrapped("clip_grad_norm_")[1].clip_grad_norm_(max_norm)

    def state_shard(self, optimizer: Any) -> StateShard:
        """The wrapped optimizer's :meth:`ZeroOptimizer.state_shard` (``optimizer`` is that optimizer)."""
        _, zero_optimizer = self._wrapped("state_shard")
        return zero_optimizer.state_shard()

    def full_state_dict(self) -> dict[str, Tensor]:
        return self._wrapped("full_state_dict")[0].state_dict()

    def load_full_state(self, model_state: dict[str, Tensor], optimizer: Any, optimizer_state: dict[str, Any]) -> None:
        model, zero_optimizer = self._wrapped("load_full_state")
        model.load_state_dict(model_state)
        zero_optimizer.load_state_dict(optimizer_state)


__all__ = ["ZeRO"]
