"""The "cp" mode: a model whose sequence is sharded over the context-parallel group.

The mode knows no particular model: it sets the ``attention_core`` of every attention module the
model's :class:`blutrain.models.ModelParallelPlan` names, and runs the model's trunk
(``hidden_states(idx, positions)``) and head. Every cp rank holds the whole model and is given the
whole batch; it keeps its two chunks of each sequence (:class:`ChunkLayout`), embeds them with their
global positions (learned position embeddings, or rotary ones at those positions), and runs the blocks
on them. Only attention looks across ranks (:mod:`blutrain_parallel_cp.attention`, ``attn=`` ring,
allgather or ulysses); every other layer is per position. Grouped-query attention's K/V heads are
repeated to the query heads before the cross-rank attention (a copy of K/V per layer: the ring and
all-gather kernels take one K/V head per query head). The attention collectives run on their
own communicator (a split of the cp group), so they never interleave with the gradient
reduction's collectives, whose place in backward may differ between ranks.

The loss: each rank computes the cross-entropy sum of its positions; the value returned is the
mean over every position of the sequence (the same on every cp rank). Its backward seeds this
rank's sum with ``cp / n_targets``, so that the gradients of the cp ranks, averaged as replicas'
gradients are, are the full sequence's. The averaging is the one replicas share
(:class:`blutrain.dist.GradientAverager`, bucketed all-reduces overlapping backward): ``CP`` has the model
average over the cp group, or, on a mesh with a "dp" dimension, leaves it to the dp mode, which averages over
dp × cp (``DDP(mesh)`` does).

Compile (``blutrain.compiler``): the cp group and the attention's communicator are declared with
:func:`blutrain.dist.traceable`, so a compiled training step is cut at each attention collective (ring:
each step's transfer is one ``sendrecv``, send and recv posted and waited for together, K/V forward and
K/V and their gradients backward; all-gather: one all-gather forward, one all-gather and one
reduce-scatter backward per layer; Ulysses: two all-to-alls each way), at the
loss's all-reduce and at the gradient averaging's, and issues them between its compiled parts. The loss
keeps its sums and counts on the device, the positions are made by kernels, and every buffer a
collective writes is made by a kernel (``zeros``), so each call repeats the traced collectives. In a
compiled step each transfer completes where it is issued: ring attention's overlap of the transfers with
the current block is given up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import save_nothing
from blutrain.dist import (
    DEFAULT_BUCKET_CAP_MB,
    DeviceMesh,
    DistArgumentError,
    GradientAverager,
    ParallelMode,
    ProcessGroup,
    broadcast_from_rank0,
    get_process_group,
    traceable,
)
from blutrain.models import head_logits, require_plan, token_loss_sum
from blutrain.nn import Module
from blutrain.tensor import Tensor, float64, full_like, stack
from blutrain.tensor.errors import ShapeError
from blutrain_parallel_cp.attention import ATTENTION_KINDS, context_parallel_attention
from blutrain_parallel_cp.layout import ChunkLayout

SEQUENCE_LOSS = "cp_sequence_loss"


class ContextParallelAttentionCore:
    """The ``attention_core`` (:class:`blutrain.models.PlannedAttention`) this mode gives each planned
    attention: q (B, H, T_local, D) and k, v (B, H_kv, T_local, D) in the layout of ``group``, attended by
    ``kind`` across the ranks; with H_kv < H (grouped-query attention) ring and all-gather move and attend
    the shared K/V heads as they are, ulysses repeats them to H."""

    def __init__(self, group: ProcessGroup, kind: str = "ring") -> None:
        if kind not in ATTENTION_KINDS:
            raise DistArgumentError(f"ContextParallelAttentionCore: kind must be one of "
                                    f"{', '.join(ATTENTION_KINDS)}, got {kind!r}")
        self.group = group
        self.kind = kind

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[1] % k.shape[1]:
            raise ShapeError(f"ContextParallelAttentionCore: q must be (B, H, T_local, D) and k, v (B, H_kv, "
                             f"T_local, D) with H a multiple of H_kv, got {list(q.shape)}, {list(k.shape)}, "
                             f"{list(v.shape)}")
        layout = ChunkLayout(q.shape[2] * self.group.size, self.group.size)
        return context_parallel_attention(q, k, v, self.group, layout, self.kind)

    def __repr__(self) -> str:
        return f"ContextParallelAttentionCore(attn={self.kind}, cp={self.group.size})"


def sequence_loss(local_sum: Tensor, local_count: Tensor | int, group: ProcessGroup) -> Tensor:
    """The mean over the whole sharded sequence of per-position losses whose sum on this rank is
    ``local_sum`` (0-d) over ``local_count`` targets; backward seeds ``local_sum`` with ``size / total``.
    Sums and counts are reduced in float64 and stay on the device (no host read: the loss compiles);
    no target anywhere gives NaN (0 / 0)."""
    with no_grad():
        count = local_count if isinstance(local_count, Tensor) else full_like(local_sum.detach(), local_count,
                                                                               dtype=float64)
        sums = stack([local_sum.detach().to(dtype=float64), count.to(dtype=float64)])
        group.all_reduce(sums, op="sum")
        value = (sums[0] / sums[1]).to(dtype=local_sum.dtype)
        scale = group.size / sums[1]
    record(SEQUENCE_LOSS, (local_sum,), value, {"scale": scale})
    return value


@derivative(SEQUENCE_LOSS, save=save_nothing)
def _sequence_loss_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    g: Tensor = grads[0]
    return (g * node.attrs["scale"].to(dtype=g.dtype),)


class ContextParallelModel(Module):
    """``model`` (a :class:`blutrain.models.Model`, or one a mode of the mesh rewrote: a
    :class:`blutrain.models.RewrittenModel`, e.g. tensor parallelism's) with its planned attentions made
    context-parallel over ``group``.

    ``forward(idx, targets=None)`` takes the whole batch (B, T), T a multiple of 2·cp, and returns
    ``(logits, loss)``: the logits of this rank's positions (B, T / cp, vocab) in layout order, and
    the mean cross-entropy over all positions (targets of -1 ignored), the same on every cp rank.

    ``average_gradients``: start from rank 0's parameters and buffers and leave every rank the cp group's
    average gradient after each backward (buckets of ``bucket_cap_mb``; ``no_sync()`` suspends it), for a
    mesh with no dp mode to average them.
    """

    def __init__(self, model: Any, group: ProcessGroup, attn: str = "ring", average_gradients: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        super().__init__()
        where = "ContextParallelModel"
        self.plan = require_plan(where, model)
        if attn not in ATTENTION_KINDS:
            raise DistArgumentError(f"{where}: attn must be one of {', '.join(ATTENTION_KINDS)}, got {attn!r}")
        heads = self.plan.head_attributes[0]  # the query heads: K/V heads are repeated to them
        for _, planned in self.plan.attentions(model):
            if attn == "ulysses" and getattr(planned, heads) % group.size:
                raise DistArgumentError(f"{where}: attn='ulysses' needs {heads} ({getattr(planned, heads)}) "
                                        f"divisible by the context-parallel size {group.size}")
        # both declared for blutrain.compiler (see the module's doc)
        self.group: ProcessGroup = traceable(group)
        self.attn = attn
        # the attention's own communicator (see the module's doc); a split is collective over the group
        self.attention_group: ProcessGroup = traceable(group.split(0, group.rank) if group.size > 1 else group)
        for _, planned in self.plan.attentions(model):
            planned.attention_core = ContextParallelAttentionCore(self.attention_group, attn)
        self.module = model
        self.averager: GradientAverager | None = None
        if average_gradients and group.size > 1:
            broadcast_from_rank0(self.group, [*model.parameters(), *model.buffers()])
            params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            self.averager = GradientAverager(params, self.group, bucket_cap_mb, owner=where)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without averaging them (when it averages)."""
        if self.averager is None:
            yield
            return
        with self.averager.no_sync():
            yield

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if self.averager is not None:
            self.averager.check_previous_backward()
        model = self.module
        model.check_ids(idx)
        rank = self.group.rank
        layout = ChunkLayout(idx.shape[1], self.group.size)
        x = model.hidden_states(layout.shard(idx, rank), layout.position_ids(rank, idx.device))
        logits = head_logits(model, x)
        if targets is None:
            return logits, None
        if not isinstance(targets, Tensor) or targets.shape != idx.shape:
            got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise ShapeError(f"ContextParallelModel: targets must have the shape of idx {list(idx.shape)}, got {got}")
        mine = layout.shard(targets, rank).reshape(-1)
        B, T, V = logits.shape
        local, count = token_loss_sum(model, logits.reshape(B * T, V), mine)
        return logits, sequence_loss(local, count, self.group)

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, rank {self.group.rank}, attn={self.attn}"


class CP(ParallelMode):
    """The "cp" parallelism mode: ``CP(mesh, attn="ring"|"allgather"|"ulysses").wrap_model(model)`` over
    the mesh's "cp" dimension (or a process group itself). Without a "dp" dimension the model also
    averages its gradients over the cp group (``average_gradients`` of :class:`ContextParallelModel`); with
    one, the dp mode averages over dp × cp. The optimizer is unchanged.

    The wrapped model computes the loss over the whole sequence itself and its attentions take this rank's
    chunks (``shards_loss``, ``rewrites_layers``); parameters and gradients stay whole on every rank. A
    sequence is cut into two chunks per rank (:meth:`sequence_multiple`)."""

    dim = "cp"
    compiles = True  # ContextParallelModel declares its groups with blutrain.dist.traceable (see the module doc)
    on_mesh = True
    mesh_order = 1  # between dp and tp
    mesh_options: ClassVar[Mapping[str, str]] = {"attn": "attn"}
    shards_loss = True
    rewrites_layers = True
    wraps_rewritten = True  # the planned attentions of a tensor-parallel model are its ranks' heads

    @classmethod
    def check_options(cls, attn: str = "ring", bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        if attn not in ATTENTION_KINDS:
            raise DistArgumentError(f"CP: attn must be one of {', '.join(ATTENTION_KINDS)}, got {attn!r}")

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, attn: str = "ring",
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        self.check_options(attn, bucket_cap_mb)
        if isinstance(mesh, DeviceMesh):
            self.group = mesh.get_group(self.dim)
            self.average_gradients = "dp" not in mesh.names
        else:
            self.group = get_process_group() if mesh is None else mesh
            self.average_gradients = True
        self.attn = attn
        self.bucket_cap_mb = bucket_cap_mb
        self.model: ContextParallelModel | None = None

    @classmethod
    def sequence_multiple(cls, size: int) -> int:
        return 2 * size  # two chunks of every sequence per rank (the load-balanced causal layout)

    def wrap_model(self, model: Any) -> ContextParallelModel:
        self.model = ContextParallelModel(model, self.group, self.attn, average_gradients=self.average_gradients,
                                          bucket_cap_mb=self.bucket_cap_mb)
        return self.model

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync() if self.model is not None else contextlib.nullcontext()


__all__ = ["CP", "ContextParallelAttentionCore", "ContextParallelModel", "sequence_loss"]
