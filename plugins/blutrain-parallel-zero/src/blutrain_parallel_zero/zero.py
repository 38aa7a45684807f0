"""The "zero" parallelism mode: ``ZeRO(mesh, stage)`` wraps the model, then the optimizer built over it."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

from blutrain.dist import (
    DeviceMesh,
    DistArgumentError,
    ParallelMode,
    Placement,
    ProcessGroup,
    StateShard,
    check_reduction,
    get_process_group,
    take_range,
    whole_placements,
)
from blutrain.tensor import Tensor
from blutrain_parallel_zero.model import DEFAULT_BUCKET_CAP_MB, STAGES, ZeroModel
from blutrain_parallel_zero.optimizer import ZeroOptimizer


class ZeRO(ParallelMode):
    """ZeRO over the mesh's "dp" dimension (dp × cp where the mesh has a "cp" dimension: context-parallel
    ranks hold replicas too), or a process group itself: ``stage`` 1 shards the optimizer state, 2 also the
    gradients, 3 also the parameters. Call :meth:`wrap_model` first, then :meth:`wrap_optimizer` with the
    optimizer built over the (unwrapped) model's parameters.

    Every stage keeps a shard of the gradient's reduction on each rank and a shard of the optimizer state,
    so the global gradient norm and checkpoints go through the mode (``shards_gradients``, ``shards_state``).
    On a mesh the form ``dp=2,tp=2,zero=STAGE`` runs it along dp in place of DDP (``on_mesh_by_name``); over
    tensor parallelism it shards each rank's blocks (``nests_state``): its shards are windows of the tp
    ranges, its norm sums over dp × tp, and a checkpoint has one file per rank of dp (× cp) × tp.

    ``reduce="ordered"`` (``--parallel zero=2,reduce=ordered``, ``dp=4,zero=1,reduce=ordered``) sums the
    gradients over the ranks in rank order instead of the comm backend's reduce-scatter
    (:mod:`blutrain_parallel_zero.model`'s doc: the gradient shards are one process's bits, a clipped update is
    not)."""

    dim = "dp"
    splits_batch = True  # each replica trains on its own rows of the batch
    compiles = True  # ZeroModel declares its groups with blutrain.dist.traceable (see blutrain_parallel_zero.model)
    shards_gradients = True
    shards_state = True
    on_mesh_by_name = True
    nests_state = True
    mesh_options: ClassVar[Mapping[str, str]] = {"reduce": "reduce"}  # dp=4,zero=2,reduce=ordered

    @classmethod
    def check_options(cls, stage: int = 2, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                      reduce: str = "backend") -> None:
        if isinstance(stage, bool) or stage not in STAGES:
            raise DistArgumentError(f"ZeRO: stage must be 1, 2 or 3, got {stage!r}")
        check_reduction("ZeRO", reduce)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, stage: int = 2,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, reduce: str = "backend") -> None:
        self.check_options(stage, bucket_cap_mb, reduce)
        self.mesh: DeviceMesh | None = None
        self._state_dims: tuple[str, ...] = (self.dim,)
        if isinstance(mesh, DeviceMesh):
            # context-parallel ranks hold replicas too (each saw part of the sequence): shard over dp × cp
            self.mesh = mesh
            self._state_dims = (self.dim, "cp") if "cp" in mesh.names else (self.dim,)
            self.group = mesh.get_group(*self._state_dims)
        else:
            self.group = get_process_group() if mesh is None else mesh
        self.shard_group = self.group  # the ranks among which each tensor is sharded; group: every part (nest)
        self.stage = int(stage)
        self.bucket_cap_mb = bucket_cap_mb
        self.reduce = reduce
        self.placed: list[Placement] | None = None
        self.inner: ParallelMode | None = None
        self.model: ZeroModel | None = None
        self.optimizer: ZeroOptimizer | None = None

    @property
    def state_dims(self) -> tuple[str, ...]:
        return self._state_dims

    def nest(self, net: Any, inner: ParallelMode | None) -> None:
        """Shard ``net``'s tensors as ``inner`` placed them (None: whole), named as the single-process model
        names them; with ``inner``, :attr:`group` becomes the ranks of this mode's group times ``inner``'s
        (one checkpoint file each; the norm sums over them), made here: collective over the mesh."""
        if self.model is not None:
            raise DistArgumentError("ZeRO.nest: call it before wrap_model")
        if inner is not None and self.mesh is None:
            raise DistArgumentError(f"ZeRO.nest: nesting over mode {type(inner).__name__} needs a DeviceMesh "
                                    "holding both modes' dimensions; ZeRO was made over a process group")
        self.placed = inner.placements() if inner is not None else whole_placements(net.state_dict(keep_vars=True))
        self.inner = inner
        if inner is not None and self.mesh is not None:
            self._state_dims = (*self._state_dims, *(d for d in inner.state_dims if d not in self._state_dims))
            self.group = self.mesh.get_group(*self._state_dims)

    def placements(self) -> list[Placement]:
        """Refused: ZeRO's shards are flat buckets, not tensors of the model, so no mode can nest over ZeRO."""
        raise DistArgumentError("ZeRO.placements: ZeRO's shards are flat buckets, not tensors of the model; ZeRO "
                                "must be the outermost mode that shards state")

    def wrap_model(self, model: Any) -> ZeroModel:
        if self.model is not None:
            raise DistArgumentError("ZeRO.wrap_model: this mode already wraps a model; build one ZeRO per model")
        self.model = ZeroModel(model, self.shard_group, self.stage, self.bucket_cap_mb, placements=self.placed,
                               norm_group=self.group, reduce=self.reduce)
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

    def no_sync(self) -> AbstractContextManager[None]:
        """Stage 1 launches no gradient reduction in the backward passes inside (gradient accumulation)."""
        return self.model.no_sync() if self.model is not None else nullcontext()

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
        """The single-process model's ``state_dict()``: gathered over this mode's ranks, then, nested, by the
        inner mode over its own (a collective over :attr:`group`)."""
        model = self._wrapped("full_state_dict")[0]
        if self.inner is None:
            return model.state_dict()
        with model.gathered():  # stage 3: every rank's tensors whole for the inner mode to gather
            return self.inner.full_state_dict()

    def load_full_state(self, model_state: dict[str, Tensor], optimizer: Any, optimizer_state: dict[str, Any]) -> None:
        """Each rank cuts its tensors out of whole state (as the placements say) and keeps its shards of them.
        No collective."""
        model, zero_optimizer = self._wrapped("load_full_state")
        full = {pl.name: pl for pl in model.placements}
        local = {}
        for name, t in model_state.items():
            pl = full.get(name)
            local[name] = t if pl is None or pl.whole else self._cut(model, pl, t, "model state")
        params = [p for g in zero_optimizer.param_groups for p in g["params"]]
        entries = {}
        for i, entry in optimizer_state.get("state", {}).items():
            p = params[int(i)] if 0 <= int(i) < len(params) else None
            pl = model.placement(p) if p is not None else None
            if pl is not None and not pl.whole:  # the state tensors of the parameter's shape: this rank's part
                entry = {k: self._cut(model, pl, v, f"optimizer state {k!r}")
                         if isinstance(v, Tensor) and tuple(v.shape) == pl.shape else v for k, v in entry.items()}
            entries[i] = entry
        model.load_state_dict(local)
        zero_optimizer.load_state_dict({**optimizer_state, "state": entries})

    @staticmethod
    def _cut(model: ZeroModel, pl: Placement, t: Tensor, what: str) -> Tensor:
        """This rank's tensor of placement ``pl`` out of the whole tensor ``t``."""
        if tuple(t.shape) != pl.shape:
            raise DistArgumentError(f"ZeRO.load_full_state: {what} of {pl.name!r} must have the single-process "
                                    f"shape {list(pl.shape)}, got {list(t.shape)}")
        return take_range(t, pl.range, "ZeRO.load_full_state").reshape(*model.local_shapes[pl.name])


__all__ = ["ZeRO"]
