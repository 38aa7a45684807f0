"""The "cp" mode: a GPT-2 whose sequence is sharded over the context-parallel group.

Every cp rank holds the whole model and is given the whole batch; it keeps its two chunks of each
sequence (:class:`ChunkLayout`), embeds them with their global positions, and runs the blocks on
them. Only attention looks across ranks (:mod:`blutrain_parallel_cp.attention`, ``attn=`` ring,
allgather or ulysses); every other layer is per position. The attention collectives run on their
own communicator (a split of the cp group), so they never interleave with the gradient
reduction's collectives, whose place in backward may differ between ranks.

The loss: each rank computes the cross-entropy sum of its positions; the value returned is the
mean over every position of the sequence (the same on every cp rank). Its backward seeds this
rank's sum with ``cp / n_targets``, so that the gradients of the cp ranks, averaged as replicas'
gradients are, are the full sequence's. The averaging is the ``ddp`` mode's: ``CP`` wraps the model
in :class:`~blutrain_parallel_ddp.DistributedDataParallel` over the cp group, or, on a mesh with a
"dp" dimension, leaves it to the dp mode, which averages over dp × cp (``DDP(mesh)`` does).

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

from typing import Any

from blutrain.autograd import checkpoint, derivative, is_grad_enabled, no_grad, record
from blutrain.autograd.rules import save_nothing
from blutrain.dist import DeviceMesh, DistArgumentError, ProcessGroup, get_process_group, traceable
from blutrain.models import GPT2
from blutrain.nn import CausalSelfAttention, Module
from blutrain.tensor import Tensor, cross_entropy, float64, full_like, stack
from blutrain.tensor.errors import ShapeError
from blutrain_parallel_cp.attention import ATTENTION_KINDS, context_parallel_attention
from blutrain_parallel_cp.layout import ChunkLayout
from blutrain_parallel_ddp import DEFAULT_BUCKET_CAP_MB, DistributedDataParallel

SEQUENCE_LOSS = "cp_sequence_loss"


class ContextParallelSelfAttention(Module):
    """GPT-2's ``CausalSelfAttention`` (same ``c_attn``, ``c_proj``, ``resid_dropout``) over a sharded
    sequence: input (B, T_local, C) in the layout of ``group``, attention by ``kind``."""

    def __init__(self, attn: CausalSelfAttention, group: ProcessGroup, kind: str = "ring") -> None:
        super().__init__()
        if not isinstance(attn, CausalSelfAttention):
            raise DistArgumentError(f"ContextParallelSelfAttention: attn must be a CausalSelfAttention, got "
                                    f"{type(attn).__name__}")
        if kind not in ATTENTION_KINDS:
            raise DistArgumentError(f"ContextParallelSelfAttention: kind must be one of "
                                    f"{', '.join(ATTENTION_KINDS)}, got {kind!r}")
        self.n_embd = attn.n_embd
        self.n_head = attn.n_head
        self.c_attn = attn.c_attn
        self.c_proj = attn.c_proj
        self.resid_dropout = attn.resid_dropout
        self.group = group
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 3 or x.shape[2] != self.n_embd:
            raise ShapeError(f"ContextParallelSelfAttention: input must be (B, T_local, {self.n_embd}), got "
                             f"{list(x.shape)}")
        B, T, C = x.shape
        H = self.n_head
        layout = ChunkLayout(T * self.group.size, self.group.size)
        q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = context_parallel_attention(q, k, v, self.group, layout, self.kind)
        out: Tensor = self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return out

    def extra_repr(self) -> str:
        return f"n_embd={self.n_embd}, n_head={self.n_head}, attn={self.kind}, cp={self.group.size}"


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


class ContextParallelGPT2(Module):
    """``model`` (a :class:`~blutrain.models.GPT2`) with its attention made context-parallel over ``group``.

    ``forward(idx, targets=None)`` takes the whole batch (B, T), T a multiple of 2·cp, and returns
    ``(logits, loss)``: the logits of this rank's positions (B, T / cp, vocab) in layout order, and
    the mean cross-entropy over all positions (targets of -1 ignored), the same on every cp rank.
    """

    def __init__(self, model: GPT2, group: ProcessGroup, attn: str = "ring") -> None:
        super().__init__()
        if not isinstance(model, GPT2):
            raise DistArgumentError(f"ContextParallelGPT2: model must be a GPT2, got {type(model).__name__}")
        if attn not in ATTENTION_KINDS:
            raise DistArgumentError(f"ContextParallelGPT2: attn must be one of {', '.join(ATTENTION_KINDS)}, got "
                                    f"{attn!r}")
        if attn == "ulysses" and model.config.n_head % group.size:
            raise DistArgumentError(f"ContextParallelGPT2: attn='ulysses' needs n_head ({model.config.n_head}) "
                                    f"divisible by the context-parallel size {group.size}")
        # both declared for blutrain.compiler (see the module's doc)
        self.group: ProcessGroup = traceable(group)
        self.attn = attn
        # the attention's own communicator (see the module's doc); a split is collective over the group
        self.attention_group: ProcessGroup = traceable(group.split(0, group.rank) if group.size > 1 else group)
        for block in model.transformer.h:
            block.add_module("attn", ContextParallelSelfAttention(block.attn, self.attention_group, attn))
        self.module = model

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        model: GPT2 = self.module
        model.check_ids(idx)
        rank = self.group.rank
        layout = ChunkLayout(idx.shape[1], self.group.size)
        tr = model.transformer
        x: Tensor = tr.drop(tr.wte(layout.shard(idx, rank)) + tr.wpe(layout.position_ids(rank, idx.device)))
        recompute = model.config.checkpoint_activations and self.training and is_grad_enabled() and x.requires_grad
        for block in tr.h:
            x = checkpoint(block, x) if recompute else block(x)
        logits: Tensor = model.lm_head(tr.ln_f(x))
        if targets is None:
            return logits, None
        if not isinstance(targets, Tensor) or targets.shape != idx.shape:
            got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise ShapeError(f"ContextParallelGPT2: targets must have the shape of idx {list(idx.shape)}, got {got}")
        mine = layout.shard(targets, rank).reshape(-1)
        B, T, V = logits.shape
        local = cross_entropy(logits.reshape(B * T, V), mine, ignore_index=-1, reduction="sum")
        return logits, sequence_loss(local, (mine != -1).sum(), self.group)

    def extra_repr(self) -> str:
        return f"cp={self.group.size}, rank {self.group.rank}, attn={self.attn}"


class CP:
    """The "cp" parallelism mode: ``CP(mesh, attn="ring"|"allgather"|"ulysses").wrap_model(gpt2)`` over
    the mesh's "cp" dimension (or a process group itself). Without a "dp" dimension the result is
    also wrapped in ``DistributedDataParallel`` over the cp group (gradient averaging); with one,
    the dp mode averages over dp × cp. The optimizer is unchanged."""

    dim = "cp"
    compiles = True  # ContextParallelGPT2 declares its groups with blutrain.dist.traceable (see the module doc)

    def __init__(self, mesh: DeviceMesh | ProcessGroup | None = None, attn: str = "ring",
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        if attn not in ATTENTION_KINDS:
            raise DistArgumentError(f"CP: attn must be one of {', '.join(ATTENTION_KINDS)}, got {attn!r}")
        if isinstance(mesh, DeviceMesh):
            self.group = mesh.get_group(self.dim)
            self.average_gradients = "dp" not in mesh.names
        else:
            self.group = get_process_group() if mesh is None else mesh
            self.average_gradients = True
        self.attn = attn
        self.bucket_cap_mb = bucket_cap_mb

    def wrap_model(self, model: Any) -> Module:
        wrapped = ContextParallelGPT2(model, self.group, self.attn)
        if self.average_gradients and self.group.size > 1:
            return DistributedDataParallel(wrapped, self.group, self.bucket_cap_mb)
        return wrapped

    def wrap_optimizer(self, optimizer: Any) -> Any:
        return optimizer


__all__ = ["CP", "ContextParallelGPT2", "ContextParallelSelfAttention", "sequence_loss"]
