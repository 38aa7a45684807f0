"""The "tp" mode: a model rewritten in place into Megatron tensor parallelism, as its parallel plan says.

The mode knows no particular model: it applies the model's :class:`blutrain.models.ModelParallelPlan`.
In every block the plan's column-parallel Linears are cut by output features (a fused q/k/v projection
in its three parts, so each rank keeps whole heads: its rows of q, of k and of v), its row-parallel ones
by input features, and the attention's head counts divided by the group size; so each block does one
all-reduce forward per row-parallel layer and one backward per column-parallel input. The token
embedding becomes vocab-parallel and the LM head too (a tied head uses the embedding's shard, an untied
one is a column-parallel Linear over the vocabulary): each rank computes the logits of its part of the
vocabulary, and the vocab-parallel cross-entropy reduces three values per token, so no rank holds full
logits. Everything else (norms, position embeddings, row-parallel biases) is replicated; their gradients
are equal on every rank (their inputs and output gradients are), so they need no reduction.

The model is cut from full weights: rank 0 of the group broadcasts its parameters first (so every
rank starts from the same model) and each rank slices its part, hence a single-process checkpoint
loads by loading it into the model before wrapping; :meth:`TensorParallelModel.full_parameters`
gathers them back. A wrapped model loads whole state too (:meth:`~TensorParallelModel.load_full_state_dict`,
each rank slicing its blocks), and :meth:`~TensorParallelModel.checkpoint_shard` describes each rank's
blocks as ranges of the full tensors, so every rank writes its own part of a checkpoint.

``async_chunks=k`` (k >= 1) runs the parallel Linears and the LM head as the fused ops of
:mod:`blutrain_parallel_tp.overlap`: each all-reduce cut into k row blocks overlapping the GEMMs.

Compile (``blutrain.compiler``): the group is declared with :func:`blutrain.dist.traceable` and every
layer, the vocab-parallel loss and the gradient norm use it, so each all-reduce (per block: two forward,
two backward; the embedding's, the loss's three and the norm's) is an op of the compiled step's one
program (on CUDA a branch of its graph on a communication stream, joined by the first op that reads its
buffer). Nothing chooses by values (the loss's count of targets stays a device value), and the buffers
the all-reduces write are made by kernels (clones, GEMM results). With ``async_chunks`` each row block's
all-reduce is such an op too, joined where the blocks are concatenated, so the next block's GEMM may run
beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from blutrain.autograd import no_grad
from blutrain.dist import (
    DeviceMesh,
    DistArgumentError,
    ParallelMode,
    Placement,
    ProcessGroup,
    StateShard,
    get_process_group,
    traceable,
)
from blutrain.models import RewrittenModel, module_at, replace_module, require_plan
from blutrain.nn import Embedding, Linear, Module
from blutrain.optim import global_norm, scale_
from blutrain.tensor import Tensor, clamp, zeros
from blutrain.tensor.errors import ShapeError
from blutrain_parallel_tp.comm import copy_to_tp_region
from blutrain_parallel_tp.cross_entropy import vocab_parallel_cross_entropy
from blutrain_parallel_tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    full_shape,
    gather_shard,
    shard_range,
    slice_shard,
)
from blutrain_parallel_tp.overlap import check_chunks, column_parallel_linear


def _expect(where: str, what: str, value: object, kind: type) -> Any:
    if not isinstance(value, kind):
        raise DistArgumentError(f"{where}: {what} must be a {kind.__name__}, got {type(value).__name__}")
    return value


class TensorParallelModel(RewrittenModel):
    """``model`` (a :class:`blutrain.models.Model`) rewritten for tensor parallelism over ``group`` as its
    ``parallel_plan`` says.

    ``forward(idx, targets=None)`` returns ``(logits, loss)`` as the model's, where ``logits`` is this
    rank's vocabulary shard (B, T, vocab_size / tp) and ``loss`` the full mean cross-entropy, the
    same on every rank. Parameter names are the model's, under ``module.``. ``async_chunks`` > 0: the
    parallel Linears and the LM head overlap their all-reduce with their GEMMs in that many row blocks.
    As a :class:`~blutrain.models.RewrittenModel` it serves the next mode of a mesh (context parallelism):
    :meth:`logits` gives this rank's vocabulary shard and :meth:`loss_sum` the vocab-parallel loss.
    """

    def __init__(self, model: Any, group: ProcessGroup, broadcast_parameters: bool = True,
                 async_chunks: int = 0) -> None:
        super().__init__()
        where = "TensorParallelModel"
        if isinstance(model, RewrittenModel):
            raise DistArgumentError(f"{where}: model is already rewritten ({type(model).__name__}); tensor "
                                    "parallelism cuts a plain model's layers, so it must be the innermost mode")
        self.plan = require_plan(where, model)
        self.async_chunks = check_chunks(where, async_chunks) if async_chunks else 0
        size = group.size
        c = model.config
        for _, attn in self.plan.attentions(model):
            for name in self.plan.head_attributes:
                if getattr(attn, name) % size:
                    raise DistArgumentError(f"{where}: {name} ({getattr(attn, name)}) must be divisible by the "
                                            f"tensor-parallel size {size} (each rank keeps whole heads)")
        if c.vocab_size % size:
            raise DistArgumentError(f"{where}: vocab_size ({c.vocab_size}) must be divisible by the tensor-parallel "
                                    f"size {size}; pad the vocabulary (GPT-2's 50257 → 50304)")
        # declared for blutrain.compiler: every layer, the loss and the norm use this group (see the module doc)
        self.group: ProcessGroup = traceable(group)
        if broadcast_parameters and size > 1:
            with no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    group.broadcast(t.detach(), src=0)
        self._shards: dict[int, Shard] = {}
        self._rewrite(model)
        self.module = model

    def _parallel(self, m: Any) -> Any:
        for name, shard in m.shards().items():
            self._shards[id(getattr(m, name))] = shard
        return m

    def _rewrite(self, model: Module) -> None:
        g, k, plan = self.group, self.async_chunks, self.plan
        where = "TensorParallelModel"
        for prefix, block in plan.block_modules(model):
            for path, parts in plan.column.items():
                full = _expect(where, f"{prefix}.{path}", module_at(block, path), Linear)
                replace_module(block, path, self._parallel(ColumnParallelLinear.from_linear(
                    full, g, parts=parts, async_chunks=k)))
            for path in plan.row:
                full = _expect(where, f"{prefix}.{path}", module_at(block, path), Linear)
                replace_module(block, path, self._parallel(RowParallelLinear.from_linear(full, g, async_chunks=k)))
            attn = module_at(block, plan.attention)
            for name in plan.head_attributes:  # the heads this rank computes; the attention splits by them
                setattr(attn, name, getattr(attn, name) // g.size)
        emb = _expect(where, plan.vocab_embedding, module_at(model, plan.vocab_embedding), Embedding)
        head = _expect(where, plan.head, module_at(model, plan.head), Linear)
        tied = head.weight is emb.weight
        wte = self._parallel(VocabParallelEmbedding.from_embedding(emb, g))
        replace_module(model, plan.vocab_embedding, wte)
        if tied:
            head.weight = wte.weight  # still tied: the head's rows are this rank's vocabulary
            head.out_features = wte.per_rank
        else:  # this rank's rows of the head: the logits of the embedding shard's vocabulary
            replace_module(model, plan.head, self._parallel(ColumnParallelLinear.from_linear(head, g, async_chunks=k)))
        self.vocab_start = wte.vocab_start  # the first vocabulary id whose logit this rank computes

    def logits(self, x: Tensor) -> Tensor:
        """The logits of this rank's vocabulary shard (..., vocab_size / tp) from hidden states ``x``."""
        head = module_at(self.module, self.plan.head)
        out: Tensor
        if isinstance(head, ColumnParallelLinear):  # an untied head, cut by _rewrite
            out = head(x)
        else:
            out = (column_parallel_linear(x, head.weight, head.bias, self.group, self.async_chunks)
                   if self.async_chunks and self.group.size > 1 else head(copy_to_tp_region(x, self.group)))
        return out

    def loss_sum(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        total = vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_start, ignore_index=-1,
                                             reduction="sum")
        return total, (targets != -1).sum()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        model = self.module
        model.check_ids(idx)
        logits = self.logits(model.hidden_states(idx))
        if targets is None:
            return logits, None
        if not isinstance(targets, Tensor) or targets.shape != idx.shape:
            got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise ShapeError(f"TensorParallelModel: targets must have the shape of idx {list(idx.shape)}, got {got}")
        B, T, V = logits.shape
        loss = vocab_parallel_cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), self.group,
                                            self.vocab_start, ignore_index=-1)
        return logits, loss

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter of the single-process model, by its name (collective over the group:
        sharded ones are all-gathered)."""
        out: dict[str, Tensor] = {}
        for name, p in self.module.named_parameters():
            shard = self._shards.get(id(p))
            out[name] = gather_shard(p, shard, self.group) if shard is not None else p.detach().clone()
        return out

    def full_state_dict(self) -> dict[str, Tensor]:
        """The single-process model's ``state_dict()`` (collective over the group: sharded parameters are
        all-gathered)."""
        return {**self.module.state_dict(), **self.full_parameters()}

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer.state_dict()`` (an optimizer over this model's parameters, in the single-process
        order) as the single-process optimizer's: each state tensor shaped like its sharded parameter
        (AdamW's moments) is all-gathered, everything else is kept. Collective over the group."""
        state = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        full: dict[int, dict[str, Any]] = {}
        for i, entry in state["state"].items():
            p = params[i]
            shard = self._shards.get(id(p))
            full[i] = {k: gather_shard(v, shard, self.group)
                       if shard is not None and isinstance(v, Tensor) and v.shape == p.shape else v
                       for k, v in entry.items()}
        return {**state, "state": full}

    def load_full_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load the single-process model's ``state_dict()`` (a plain checkpoint's, or merged shards):
        each rank keeps its block of every sharded tensor. No collective."""
        tensors = dict(self.module.named_parameters(remove_duplicate=False))
        local = {}
        for name, t in state.items():
            shard = self._shards.get(id(tensors[name])) if name in tensors else None
            local[name] = slice_shard(t, shard, self.group.rank, self.group.size) if shard is not None else t
        self.module.load_state_dict(local)

    def load_full_optimizer_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """``optimizer.load_state_dict`` of the single-process optimizer's state (what
        :meth:`full_optimizer_state_dict` gives, or merged shards): every state tensor shaped like a
        sharded parameter's full tensor is cut to this rank's block. No collective."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        mine: dict[Any, dict[str, Any]] = {}
        for i, entry in state["state"].items():
            p = params[int(i)]
            shard = self._shards.get(id(p))
            whole = full_shape(tuple(p.shape), shard, self.group.size) if shard is not None else None
            mine[i] = {k: slice_shard(v, shard, self.group.rank, self.group.size)
                       if shard is not None and isinstance(v, Tensor) and tuple(v.shape) == whole else v
                       for k, v in entry.items()}
        optimizer.load_state_dict({**state, "state": mine})

    def placements(self) -> list[Placement]:
        """Where each tensor of this rank's model state sits in the single-process state: a sharded one is
        its block's range of the full tensor (:func:`~blutrain_parallel_tp.shard_range`), a replicated one
        the whole tensor, saved by rank 0 of the group only (every rank holds the same). No collective."""
        rank, size = self.group.rank, self.group.size
        out = []
        for name, t in self.module.state_dict(keep_vars=True).items():
            cut = self._shards.get(id(t))
            if cut is None:
                out.append(Placement(t, name, tuple(t.shape), (0, t.numel()), saved=rank == 0))
            else:
                shape = full_shape(tuple(t.shape), cut, size)
                out.append(Placement(t, name, shape, shard_range(shape, cut, rank, size)))
        return out

    def checkpoint_shard(self, optimizer: Any) -> StateShard:
        """This rank's part of a sharded checkpoint, with no collective: its block of every sharded
        tensor as a range of the full tensor (:func:`~blutrain_parallel_tp.shard_range`), the
        replicated tensors whole on rank 0 of the group only (each element is saved once), the
        optimizer's state of the same elements, and its parameter groups by name. Shards of every tp
        rank merge into the single-process state (:func:`blutrain.dist.merge_shards`)."""
        rank, size = self.group.rank, self.group.size
        by_name = dict(self.module.named_parameters())
        names = {id(p): n for n, p in by_name.items()}
        shard = StateShard(shapes={})
        for name, t in self.module.state_dict().items():
            cut = self._shards.get(id(by_name[name])) if name in by_name else None
            shape = tuple(t.shape)
            if cut is not None:
                shard.shapes[name] = full_shape(shape, cut, size)
                shard.ranges[name] = shard_range(shard.shapes[name], cut, rank, size)
            else:
                shard.shapes[name] = shape
                if rank != 0 or not t.numel():
                    continue
                shard.ranges[name] = (0, t.numel())
            shard.params[name] = t.detach().reshape(-1)
        state = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, entry in state["state"].items():
            p = params[int(i)]
            name = names[id(p)]
            if name in shard.ranges:
                shard.optimizer[name] = {k: v.detach().reshape(-1) if isinstance(v, Tensor) and v.shape == p.shape
                                         else v for k, v in entry.items()}
        shard.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                               "params": [names[id(params[int(i)])] for i in g["params"]]}
                              for g in state["param_groups"]]
        return shard

    def grad_norm(self) -> Tensor:
        """The L2 norm of the whole model's gradient, the same on every rank (collective over the
        group): the squares of each rank's shards are summed over the group, and a replicated
        parameter's (LayerNorms, ``wpe``, row-parallel biases: equal on every rank) counted once, from
        rank 0 of the group."""
        with no_grad():
            grads = [p.grad.detach() for p in self.module.parameters()
                     if p.grad is not None and (id(p) in self._shards or self.group.rank == 0)]
            first = next(iter(self.module.parameters()))
            # one multi-tensor norm over this rank's gradients (a norm per tensor would be several launches each)
            local = global_norm(grads) if grads else zeros((), dtype=first.dtype, device=first.device)
            sq = local * local
            self.group.all_reduce(sq, op="sum")
            total: Tensor = sq ** 0.5
            return total

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> Tensor:
        """As :func:`blutrain.optim.clip_grad_norm_` over the whole model: scale every gradient by
        ``min(1, max_norm / (norm + eps))`` with the global norm of :meth:`grad_norm`, so every rank
        applies the same coefficient; returns the norm before clipping."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0 or not \
                math.isfinite(max_norm):
            raise DistArgumentError(f"TensorParallelModel.clip_grad_norm_: max_norm must be a finite number > 0, "
                                    f"got {max_norm!r}")
        total = self.grad_norm()
        with no_grad():
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            if grads:
                scale_(grads, clamp(max_norm / (total + eps), max=1.0))
        return total

    def extra_repr(self) -> str:
        return (f"tp={self.group.size}, rank {self.group.rank}"
                + (f", async_chunks={self.async_chunks}" if self.async_chunks else ""))


class TP(ParallelMode):
    """The "tp" parallelism mode: ``TP(mesh).wrap_model(model)`` over the mesh's "tp" dimension (or a
    process group itself); the optimizer is unchanged (it updates each rank's shards). ``async_chunks``
    k >= 1: async TP, each layer's all-reduce in k row blocks overlapping its GEMMs (0: synchronous; the mesh
    form's ``async=k``).

    The wrapped model computes the vocab-parallel loss itself, its layers take sharded inputs, each rank holds
    the gradients of its shards, and checkpoints hold each rank's blocks: every capability flag is set, each
    served by the :class:`TensorParallelModel` that :meth:`wrap_model` made."""

    dim = "tp"
    compiles = True  # TensorParallelModel declares its group with blutrain.dist.traceable (see the module doc)
    on_mesh = True
    mesh_order = 2  # innermost: a tp group's ranks all-reduce in every layer, so they are neighbours
    mesh_options: ClassVar[Mapping[str, str]] = {"async": "async_chunks"}
    shards_loss = True
    rewrites_layers = True
    shards_gradients = True
    shards_state = True

    @classmethod
    def check_options(cls, broadcast_parameters: bool = True, async_chunks: int = 0) -> None:
        if async_chunks:
            check_chunks("TP", async_chunks)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, broadcast_parameters: bool = True,
                 async_chunks: int = 0) -> None:
        if isinstance(mesh, DeviceMesh):
            self.group = mesh.get_group(self.dim)
        else:
            self.group = get_process_group() if mesh is None else mesh
        self.broadcast_parameters = broadcast_parameters
        self.async_chunks = check_chunks("TP", async_chunks) if async_chunks else 0
        self.model: TensorParallelModel | None = None

    def wrap_model(self, model: Any) -> TensorParallelModel:
        self.model = TensorParallelModel(model, self.group, self.broadcast_parameters, self.async_chunks)
        return self.model

    def _wrapped(self, method: str) -> TensorParallelModel:
        if self.model is None:
            raise DistArgumentError(f"TP.{method}: call wrap_model first")
        return self.model

    def grad_norm(self) -> Tensor:
        return self._wrapped("grad_norm").grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        return self._wrapped("clip_grad_norm_").clip_grad_norm_(max_norm)

    def state_shard(self, optimizer: Any) -> StateShard:
        return self._wrapped("state_shard").checkpoint_shard(optimizer)

    def full_state_dict(self) -> dict[str, Tensor]:
        return self._wrapped("full_state_dict").full_state_dict()

    def placements(self) -> list[Placement]:
        return self._wrapped("placements").placements()

    def load_full_state(self, model_state: dict[str, Tensor], optimizer: Any, optimizer_state: dict[str, Any]) -> None:
        model = self._wrapped("load_full_state")
        model.load_full_state_dict(model_state)
        model.load_full_optimizer_state_dict(optimizer, optimizer_state)


__all__ = ["TP", "TensorParallelModel"]
