"""ZeroModel: the model side of ZeRO — where gradients are reduced and where parameters live.

Stage 1: every rank keeps whole parameters and local gradients (``.grad``, summed over micro-batches) and
updates its shard of the parameters. Each bucket's gradients are reduce-scattered (average) into the bucket's
``shard_grad`` as soon as a backward has accumulated all of them (post-accumulate-grad hooks, buckets launched in
index order on every rank, ``async_op=True``), so the reductions run beside the rest of backward as DDP's
all-reduces do; the optimizer waits for them. Inside :meth:`ZeroModel.no_sync` (gradient accumulation: every
micro-batch but the last) nothing is launched, and a bucket that no backward completed since the last step
(a parameter without a gradient, or a backward run inside ``no_sync`` last) is reduced at the optimizer's step.
As with DDP, a gradient changed by hand between backward and the optimizer's step is not seen.

Stages 1 and 2 all-gather the updated shards into the whole parameters lazily: the optimizer's step leaves
them *stale*, and the next forward gathers them first, in forward order (the last bucket, the first layers',
first), so that a compiled step joins each bucket's gather at its first use and the gathers run beside the
forward instead of after the update. Whatever reads the whole parameters between two steps (``state_dict``,
``gathered()``, evaluation through ``forward``) gathers them first too.

Stage 2: as each parameter's gradient is accumulated (post-accumulate-grad hook) it is copied into
its bucket's flat buffer and ``.grad`` is dropped; a complete bucket is reduce-scattered
(``async_op=True``) while backward goes on, buckets launched in index order on every rank. The last
bucket's hook waits and adds each rank's piece into its ``shard_grad``: a rank keeps 1/n of the
gradients.

Stage 3: the parameters exist only as shards. The model is cut into *units*: every element of a
``ModuleList``/``Sequential`` (a transformer's blocks) and the root, which holds the rest (embeddings,
final norm, a tied head). A unit's forward pre-hook all-gathers its parameters (waiting for a gather
started earlier when it was prefetched) and starts the gather of the next unit of the previous
forward's order; its forward hook frees them again (a root stays gathered until its backward). Hooks
on the unit's outputs gather the parameters again just before backward reaches the unit, and start
the gather of the unit before it. A unit recomputed inside backward (activation checkpointing) is
gathered for its recomputation and stays so for the backward that follows at once; it takes no part
in the forward order or its prefetch. When every parameter of a unit has its gradient, the unit's
gradients are reduce-scattered and its parameters freed. The saved tensors of the graph refer to the
parameters themselves, so a gathered buffer is rebuilt exactly as in forward (same version count).

``reduce="ordered"`` (:mod:`blutrain.dist.ordered_reduce`) replaces each reduce-scatter by an ``all_to_all`` and
a sum of the ranks' blocks in rank order, as one process accumulating the ranks' micro-batches adds: the same
bytes on the wire, plus a receive buffer of the bucket's size and an N-way sum. The gradient shards are then
bit-identical to that process's (one micro-batch per rank, N a power of two); the gradient norm (clipping) is
still summed over the shards, so a clipped run's update is not.

Compile (``blutrain.compiler``): the group is declared with :func:`blutrain.dist.traceable`, so every
reduce-scatter, all-gather and the gradient norm's all-reduce is recorded into a compiled training step as
an op, issued there on every call. Every stage makes the same collectives on every call (the hooks choose
by counts, never by values), and the buffers they write are state or made by kernels (``zeros``). The
compiled program joins each collective at the first op that touches its buffers, so stage 2's reductions,
stage 3's prefetched gathers and stages 1 and 2's gathers at the start of forward keep their overlap (on CUDA:
inside the step's one graph). A traced step always gathers at its first forward (a replay runs no Python to
ask whether the parameters are stale), and every replay marks them stale again (``capture.per_call``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from blutrain.autograd import in_backward, is_grad_enabled, no_grad
from blutrain.dist import (
    DistArgumentError,
    DistError,
    OrderedReduction,
    Placement,
    ProcessGroup,
    StateShard,
    Work,
    check_reduction,
    traceable,
    whole_placements,
)
from blutrain.nn import Module, ModuleList, Sequential
from blutrain.tensor import Tensor, capture, empty, zeros
from blutrain_parallel_zero.flat import FlatBucket

DEFAULT_BUCKET_CAP_MB = 25.0
STAGES = (1, 2, 3)
# reduce-scatters left in flight during backward: each holds its bucket's whole gradient, so an older one is
# finished (waited for and added into the shard) as a newer one starts; finishing them all only at the end
# kept every bucket's whole gradient to the end of backward: in stage 3 the whole model's fp32 gradient
# (2.9 GiB for GPT-2 774M), where it should hold a unit's or two
REDUCTIONS_IN_FLIGHT = 2


def _buckets(params: list[tuple[str, Tensor]], cap_bytes: int, rank: int, world: int,
             start: int = 0) -> list[FlatBucket]:
    """Consecutive runs of one (device, dtype), a new bucket once ``cap_bytes`` is reached."""
    out: list[FlatBucket] = []
    run: list[tuple[str, Tensor]] = []
    size = 0
    for name, p in params:
        if run and (p.device is not run[0][1].device or p.dtype is not run[0][1].dtype or size >= cap_bytes):
            out.append(FlatBucket(start + len(out), run, rank, world))
            run, size = [], 0
        run.append((name, p))
        size += p.numel() * p.dtype.itemsize
    if run:
        out.append(FlatBucket(start + len(out), run, rank, world))
    return out


class Unit:
    """A module whose own parameters (those of no inner unit) are gathered and freed together."""

    def __init__(self, name: str, module: Module, buckets: list[FlatBucket], root: bool) -> None:
        self.name, self.module, self.buckets, self.root = name, module, buckets, root
        self.fulls: list[Tensor] | None = None
        self.works: list[Work | None] = []
        self.pending = sum(len(b.params) for b in buckets)
        self.grads: dict[int, Tensor] = {}

    @property
    def size(self) -> int:
        return sum(len(b.params) for b in self.buckets)


def _unit_modules(module: Module) -> list[tuple[str, Module, list[tuple[str, Tensor]]]]:
    """(name, module, own trainable parameters) per unit, in module order; the root first."""
    units: dict[int, tuple[str, Module, list[tuple[str, Tensor]]]] = {id(module): ("", module, [])}
    containers = [m for m in module.modules() if isinstance(m, (ModuleList, Sequential))]
    members = {id(c) for m in containers for c in m.children()}
    seen: set[int] = set()

    def walk(mod: Module, prefix: str, owner: int) -> None:
        if id(mod) in members and id(mod) not in units:
            units[id(mod)] = (prefix, mod, [])
            owner = id(mod)
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if p.requires_grad:
                    units[owner][2].append((f"{prefix}.{name}" if prefix else name, p))
        for name, child in mod.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name, owner)

    walk(module, "", id(module))
    return list(units.values())


class ZeroModel(Module):
    """``module`` trained under ZeRO ``stage`` over ``group``; construction broadcasts rank 0's state.

    Every parameter that requires grad must get a gradient in each backward pass (stages 2 and 3; an
    unused one is named at the next forward). ``state_dict``/``load_state_dict`` use ``module``'s own
    names and whole tensors (stage 3 gathers them: collective), so a single-process model loads them.

    ``placements`` (on a mesh, from the inner mode that shards state, e.g. tensor parallelism): where each
    tensor of ``module``'s state sits in the single-process model; the buckets, ``state_dict`` and
    :meth:`state_shard` then use the single-process names, and a shard of a placed tensor is a window of its
    range. ``norm_group``: the ranks whose shards together hold the whole model (``group`` × the inner mode's),
    over which the gradient norm is summed; default ``group``. ``reduce``: ``"backend"`` (the comm backend's
    reduce-scatter) or ``"ordered"`` (the ranks' gradients summed in rank order; module doc).
    """

    def __init__(self, module: Module, group: ProcessGroup, stage: int = 2,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, placements: Sequence[Placement] | None = None,
                 norm_group: ProcessGroup | None = None, reduce: str = "backend") -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise DistArgumentError(f"ZeroModel: module must be a blutrain.nn.Module, got {type(module).__name__}")
        if stage not in STAGES or isinstance(stage, bool):
            raise DistArgumentError(f"ZeroModel: stage must be 1, 2 or 3, got {stage!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise DistArgumentError(f"ZeroModel: bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        self.reduce = check_reduction("ZeroModel", reduce)
        self.module = module
        self.group: ProcessGroup = traceable(group)
        # the ranks whose shards together hold the whole model (the gradient norm's sum): the group, or on a mesh
        # with a mode inside that shards state, the group times that mode's
        self.norm_group: ProcessGroup = self.group if norm_group is None else traceable(norm_group)
        self.stage = stage
        self.bucket_cap_mb = float(bucket_cap_mb)
        local = module.state_dict(keep_vars=True)
        self.placements: list[Placement] = list(whole_placements(local) if placements is None else placements)
        self._placed = {id(pl.tensor): pl for pl in self.placements}
        self._local_names = {id(t): n for n, t in local.items()}  # module's own names: what it loads
        # this rank's tensors' shapes (stage 3 frees the parameters into placeholders)
        self.local_shapes = {pl.name: tuple(pl.tensor.shape) for pl in self.placements}
        unplaced = [n for n, t in local.items() if id(t) not in self._placed]
        if unplaced:
            raise DistArgumentError(f"ZeroModel: placements must place every tensor of the model's state; they miss "
                                    f"{', '.join(unplaced[:8])}")
        rank, world = group.rank, group.size
        cap = int(self.bucket_cap_mb * 2**20)
        self.units: list[Unit] = []
        if stage < 3:
            params = [(self._placed[id(p)].name, p) for p in module.parameters() if p.requires_grad]
            self.buckets = _buckets(list(reversed(params)), cap, rank, world)  # backward's order
        else:
            self.buckets = []
            for name, mod, own in _unit_modules(module):
                own = [(self._placed[id(p)].name, p) for _, p in own]
                buckets = _buckets(own, cap, rank, world, start=len(self.buckets))
                self.buckets.extend(buckets)
                if buckets or mod is module:  # the root always: its hooks open and close each forward
                    self.units.append(Unit(name, mod, buckets, root=mod is module))
        self._names = {id(p): n for b in self.buckets for n, p in zip(b.names, b.params, strict=True)}
        # a freed parameter keeps its number of dims (weight_decay_groups tells matrices by it)
        self._placeholders = {id(p): empty(*(0,) * len(shape), dtype=b.dtype, device=b.device)
                              for b in self.buckets for p, shape in zip(b.params, b.shapes, strict=True)}
        self._fulls: dict[int, Tensor] = {}  # stages 1 and 2: the parameters live in these buffers
        with no_grad():
            for b in self.buckets:
                full = b.flatten(list(b.params))
                if world > 1:
                    group.broadcast(full, src=0)
                b.shard.copy_(b.owned(full))
                if stage < 3:
                    self._fulls[b.index] = full
                    for i, p in enumerate(b.params):
                        p.data = b.view(full, i)
                else:
                    for p in b.params:
                        p.data = self._placeholders[id(p)]
            if world > 1:
                frozen = [p for p in module.parameters() if not p.requires_grad]
                for t in [*frozen, *module.buffers()]:
                    group.broadcast(t.detach(), src=0)
        # backward bookkeeping (stages 2 and 3)
        self._pending = [len(b.params) for b in self.buckets]
        self._grad_bufs: dict[int, Tensor] = {}
        self._launched = 0
        # stage 1: the reductions the latest backward launched (bucket index → the reduce-scatter's work and the
        # flat gradient it reads, or the ordered reduction), waited for at the optimizer's step; and whether
        # backward passes communicate (False inside no_sync)
        self._stage1_reductions: dict[int, tuple[Work | OrderedReduction | None, Tensor]] = {}
        self._sync = True
        # stages 2 and 3: each reduction in flight: its bucket, and the reduce-scatter's output and work, or the
        # ordered reduction (which makes its output when it is finished)
        self._reductions: list[tuple[FlatBucket, Tensor | OrderedReduction, Work | None]] = []
        self._units_left = sum(1 for u in self.units if u.size)
        self._order: list[Unit] = []  # the previous forward's unit order (prefetch)
        self._trace: list[Unit] = []
        self._pinned = False  # inside gathered(): every unit stays gathered, the hooks stand aside
        # stages 1 and 2: the parameters lag the shards (an optimizer step since the last gather); the capture in
        # which a traced forward gathered them already (several forwards of one step gather once)
        self._stale = False
        self._gathered_in: Any = None
        if stage == 1:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._stage1_hook(b))
        elif stage == 2:
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    p.register_post_accumulate_grad_hook(self._stage2_hook(b, i))
        elif stage == 3:
            for unit in self.units:
                unit.module.register_forward_pre_hook(self._pre_forward(unit))
                unit.module.register_forward_hook(self._post_forward(unit))
                for b in unit.buckets:
                    for i, p in enumerate(b.params):
                        p.register_post_accumulate_grad_hook(self._stage3_hook(unit, b, i))

    # ----------------------------------------------------------------------------- stage 1
    def reduce_gradients(self) -> None:
        """Stage 1: every rank's ``.grad`` (local sums) → the group average of this rank's shard: the reductions
        the latest backward launched are waited for, and the buckets it did not complete are reduced now (in
        index order, the same on every rank)."""
        with no_grad():
            for b in self.buckets:
                if b.index not in self._stage1_reductions:
                    self._stage1_launch(b)
            for b in self.buckets:
                reduction, _ = self._stage1_reductions.pop(b.index)
                if isinstance(reduction, OrderedReduction):
                    b.shard_grad.copy_(reduction.reduce(scatter_only=True))
                elif reduction is not None:
                    reduction.wait()
            self._pending = [len(b.params) for b in self.buckets]
            self._launched = 0

    def _stage1_launch(self, b: FlatBucket) -> None:
        """Start bucket ``b``'s reduction of the gradients as they are now (replacing one an earlier backward
        launched: collectives run in order, so the newer result lands last)."""
        flat = b.flatten([p.grad for p in b.params])
        if self.reduce == "ordered":
            self._stage1_reductions[b.index] = (OrderedReduction(self.group, flat, op="avg"), flat)
        else:
            work = self.group.reduce_scatter(b.shard_grad, flat, op="avg", async_op=True)
            self._stage1_reductions[b.index] = (work, flat)

    def _stage1_hook(self, b: FlatBucket) -> Any:
        def on_grad(p: Tensor) -> None:
            if not self._sync:
                return
            self._pending[b.index] -= 1
            with no_grad():
                while self._launched < len(self.buckets) and self._pending[self._launched] <= 0:
                    self._stage1_launch(self.buckets[self._launched])
                    self._pending[self._launched] = len(self.buckets[self._launched].params)
                    self._launched += 1
                if self._launched == len(self.buckets):
                    self._launched = 0

        return on_grad

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate ``.grad`` locally and launch no reduction (stage 1; gradient
        accumulation's every micro-batch but the last). Stages 2 and 3 reduce every backward: nothing changes."""
        was = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = was

    def gather_parameters(self) -> None:
        """Stages 1 and 2: every rank's shard into every parameter, now (a collective), in forward order: the
        buckets hold the parameters in backward's order, so the last is the first that forward reads."""
        works = [self.group.all_gather_into_tensor(self._fulls[b.index], b.shard, async_op=True)
                 for b in reversed(self.buckets)]
        for work in works:
            if work is not None:
                work.wait()
        self._stale = False

    def mark_stale(self) -> None:
        """Stages 1 and 2, at the optimizer's step: the shards move on, the parameters are gathered again
        before they are next read. Host work only: a compiled step's replays run it again."""
        self._stale = True
        self._gathered_in = None

    def refresh(self) -> None:
        """Stages 1 and 2: the whole parameters up to date with the shards (gathered if an optimizer step
        came since the last gather; a collective then, so every rank calls it at the same point)."""
        tracing = capture.active()
        if self.stage == 3 or (not self._stale and (tracing is None or self._gathered_in is tracing)):
            return
        self.gather_parameters()
        self._gathered_in = tracing

    # ----------------------------------------------------------------------------- stage 2
    def _grad_buffer(self, b: FlatBucket) -> Tensor:
        buf = self._grad_bufs.get(b.index)
        if buf is None:
            buf = self._grad_bufs[b.index] = b.flatten([None] * len(b.params))
        return buf

    def _take_grad(self, b: FlatBucket, i: int, p: Tensor) -> None:
        grad = p.grad
        assert grad is not None
        b.view(self._grad_buffer(b), i).copy_(grad)
        p.grad = None

    def _reduce(self, b: FlatBucket) -> None:
        buf = self._grad_bufs.pop(b.index)
        if self.reduce == "ordered":
            self._reductions.append((b, OrderedReduction(self.group, buf, op="avg"), None))
        else:
            out = zeros(b.shard_numel, dtype=b.dtype, device=b.device)  # made by a kernel: see FlatBucket.full_buffer
            self._reductions.append((b, out, self.group.reduce_scatter(out, buf, op="avg", async_op=True)))
        while len(self._reductions) > REDUCTIONS_IN_FLIGHT:
            self._finish_reduction(*self._reductions.pop(0))

    @staticmethod
    def _finish_reduction(b: FlatBucket, out: Tensor | OrderedReduction, work: Work | None) -> None:
        if isinstance(out, OrderedReduction):
            out = out.reduce(scatter_only=True)  # waits for the exchange, sums this rank's block in rank order
        elif work is not None:
            work.wait()  # the stream waits; the whole-bucket gradient the collective read is let go
        b.shard_grad.add_(out)

    def _finish_reductions(self) -> None:
        for item in self._reductions:
            self._finish_reduction(*item)
        self._reductions = []

    def _stage2_hook(self, b: FlatBucket, i: int) -> Any:
        def on_grad(p: Tensor) -> None:
            if self._pending[b.index] == 0:
                raise DistError(f"ZeroModel: parameter {b.names[i]!r} got a second gradient in one backward pass "
                                "(reused module or retain_graph?)")
            with no_grad():
                self._take_grad(b, i, p)
                self._pending[b.index] -= 1
                while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
                    self._reduce(self.buckets[self._launched])
                    self._launched += 1
                if self._launched == len(self.buckets):
                    self._finish_reductions()
                    self._launched = 0
                    self._pending = [len(x.params) for x in self.buckets]

        return on_grad

    # ----------------------------------------------------------------------------- stage 3
    def _gather(self, unit: Unit) -> None:
        if unit.fulls is None:
            unit.fulls = [b.full_buffer() for b in unit.buckets]
            unit.works = [self.group.all_gather_into_tensor(f, b.shard, async_op=True)
                          for f, b in zip(unit.fulls, unit.buckets, strict=True)]

    def _materialize(self, unit: Unit) -> None:
        self._gather(unit)
        assert unit.fulls is not None
        for work in unit.works:
            if work is not None:
                work.wait()
        unit.works = []
        for full, b in zip(unit.fulls, unit.buckets, strict=True):
            for i, p in enumerate(b.params):
                p.data = b.view(full, i)

    def _free(self, unit: Unit) -> None:
        for work in unit.works:  # a prefetch nobody used: let it land before its buffer goes
            if work is not None:
                work.wait()
        unit.works = []
        unit.fulls = None
        for b in unit.buckets:
            for p in b.params:
                p.data = self._placeholders[id(p)]

    def _check_backward_done(self) -> None:
        partial = [u for u in self.units if 0 < u.pending < u.size]
        if partial or self._reductions:
            missing = [n for u in partial for b in u.buckets for n, p in zip(b.names, b.params, strict=True)
                       if id(p) not in u.grads]
            raise DistError("ZeroModel: the previous backward pass did not produce gradients for "
                            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; every parameter that "
                            "requires grad must take part in the loss (or set requires_grad=False on it)")
        for u in self.units:
            u.pending, u.grads = u.size, {}
        self._units_left = sum(1 for u in self.units if u.size)

    def _pre_forward(self, unit: Unit) -> Any:
        def hook(module: Module, args: tuple[Any, ...]) -> None:
            if self._pinned:
                return
            if in_backward():  # a checkpointed unit recomputed: its backward follows at once
                self._materialize(unit)
                return
            if unit.root:
                self._check_backward_done()
                self._trace = []
            self._trace.append(unit)
            self._materialize(unit)
            order = self._order
            if unit in order:
                k = order.index(unit) + 1
                if k < len(order):
                    self._gather(order[k])  # prefetch: overlaps this unit's compute

        return hook

    def _post_forward(self, unit: Unit) -> Any:
        def hook(module: Module, args: tuple[Any, ...], output: Any) -> None:
            if self._pinned:
                return
            backward = is_grad_enabled()
            if unit.root:
                self._order = list(self._trace)
                if not backward:
                    self._free(unit)
                return
            if backward:
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(unit))
                if in_backward():  # recomputed: kept for the backward that follows, which frees it
                    return
            self._free(unit)

        return hook

    def _pre_backward(self, unit: Unit) -> Any:
        def hook(grad: Tensor) -> None:
            if unit.fulls is not None and not unit.works:
                return
            self._materialize(unit)
            trace = self._trace
            if unit in trace:
                k = trace.index(unit) - 1
                if k >= 0 and not trace[k].root:
                    self._gather(trace[k])  # prefetch the unit backward reaches next

        return hook

    def _stage3_hook(self, unit: Unit, b: FlatBucket, i: int) -> Any:
        def on_grad(p: Tensor) -> None:
            if id(p) in unit.grads:
                raise DistError(f"ZeroModel: parameter {b.names[i]!r} got a second gradient in one backward pass "
                                "(reused module or retain_graph?)")
            grad = p.grad
            assert grad is not None
            unit.grads[id(p)] = grad
            p.grad = None
            unit.pending -= 1
            if unit.pending:
                return
            with no_grad():
                for bucket in unit.buckets:
                    for j, q in enumerate(bucket.params):
                        bucket.view(self._grad_buffer(bucket), j).copy_(unit.grads[id(q)])
                    self._reduce(bucket)
                unit.grads = {}
                self._free(unit)
                self._units_left -= 1
                if self._units_left == 0:
                    self._finish_reductions()
                    for u in self.units:
                        u.pending = u.size
                    self._units_left = sum(1 for u in self.units if u.size)

        return on_grad

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: every parameter whole inside (a collective on entry), for code that calls parts of
        the model directly (``GPT2.generate``); freed again on exit. Other stages: nothing to do."""
        if self.stage < 3 or self._pinned:
            self.refresh()
            yield
            return
        for unit in self.units:
            self._gather(unit)
        for unit in self.units:
            self._materialize(unit)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for unit in self.units:
                self._free(unit)

    # ----------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage == 2 and (self._launched or any(n != len(b.params)
                                                      for n, b in zip(self._pending, self.buckets, strict=True))):
            missing = [n for b in self.buckets for n, p in zip(b.names, b.params, strict=True)
                       if self._pending[b.index] != len(b.params) and p.grad is None]
            self._pending = [len(b.params) for b in self.buckets]
            self._launched = 0
            self._grad_bufs = {}
            raise DistError("ZeroModel: the previous backward pass did not produce gradients for "
                            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; every parameter that "
                            "requires grad must take part in the loss (or set requires_grad=False on it)")
        if self.stage == 1:  # a new forward: what earlier backward passes counted or launched is not its own
            self._pending = [len(b.params) for b in self.buckets]
            self._launched = 0
            self._stage1_reductions.clear()
        self.refresh()
        return self.module(*args, **kwargs)

    # ----------------------------------------------------------------------------- state
    def parameter_name(self, p: Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            raise DistArgumentError(f"ZeroModel: a tensor of shape {list(p.shape)} is not a trainable parameter "
                                    "of the wrapped model")
        return name

    def placement(self, p: Tensor) -> Placement:
        """Where the trainable parameter ``p`` sits in the single-process model's state."""
        self.parameter_name(p)
        return self._placed[id(p)]

    def _whole(self) -> Iterator[Placement]:
        """The placements of the state that is not sharded: frozen parameters and persistent buffers."""
        for pl in self.placements:
            if id(pl.tensor) not in self._names:
                yield pl

    def state_dict(self, keep_vars: bool = False) -> dict[str, Tensor]:
        """Whole tensors of this rank's model under the placements' names (without placements: ``module``'s own
        names; stage 3: gathered, a collective)."""
        out: dict[str, Tensor] = {}
        self.refresh()
        if self.stage == 3:
            with no_grad():
                for b in self.buckets:
                    full = b.full_buffer()
                    self.group.all_gather_into_tensor(full, b.shard)
                    for i, name in enumerate(b.names):
                        out[name] = b.view(full, i)
        for pl in self.placements:
            if pl.name not in out:
                out[pl.name] = pl.tensor if keep_vars else pl.tensor.detach()
        return {pl.name: out[pl.name] for pl in self.placements}

    def _local(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state_dict`` under the placements' names → under ``module``'s own names (other keys kept as given:
        ``module`` also loads a tied weight's other name)."""
        local_of = {pl.name: self._local_names[id(pl.tensor)] for pl in self.placements}
        return {local_of.get(k, k): v for k, v in state_dict.items()}

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> Any:
        """Whole tensors of this rank's model under the placements' names (as :meth:`state_dict` gives them):
        every rank keeps its shard of them."""
        if not isinstance(state_dict, dict):
            raise DistArgumentError(f"ZeroModel.load_state_dict: state_dict must be a dict of str → Tensor, got "
                                    f"{type(state_dict).__name__}")
        if self.stage < 3:
            result = self.module.load_state_dict(self._local(state_dict), strict)
            with no_grad():
                for b in self.buckets:
                    b.shard.copy_(b.owned(self._fulls[b.index]))
            self._stale = False  # the parameters were loaded whole, and the shards from them
            return result
        missing = [n for b in self.buckets for n in b.names if n not in state_dict]
        for b in self.buckets:
            for i, n in enumerate(b.names):
                t = state_dict.get(n)
                if t is not None and tuple(t.shape) != b.shapes[i]:
                    raise DistArgumentError(f"ZeroModel.load_state_dict: {n!r} must have shape {list(b.shapes[i])}, "
                                            f"got {list(t.shape)}")
        if strict and missing:
            raise DistArgumentError(f"ZeroModel.load_state_dict: missing keys: {', '.join(missing)}")
        with no_grad():
            for b in self.buckets:
                for seg in b.segments:
                    t = state_dict.get(b.names[seg.index])
                    if t is not None:
                        piece = t.detach().to(device=b.device, dtype=b.dtype).reshape(-1)[seg.lo:seg.hi]
                        b.shard[seg.shard_lo:seg.shard_hi].copy_(piece)
        rest = {k: v for k, v in state_dict.items() if k not in self._names.values()}
        return self.module.load_state_dict(self._local(rest), strict=False) if rest else None

    def state_shard(self) -> StateShard:
        """This rank's pieces of the parameters (the shard masters) and, on rank 0 of the group, the unsharded
        state, as parts of the single-process model's tensors: a piece of a whole tensor is its range, a piece
        of a tensor an inner mode cut is a window of that mode's range. What another rank holds the same of
        (a placement not ``saved``) is left to that rank."""
        shard = StateShard(shapes={})
        for b in self.buckets:
            for i, name in enumerate(b.names):
                shard.shapes[name] = self._placed[id(b.params[i])].shape
            for seg in b.segments:
                pl = self._placed[id(b.params[seg.index])]
                if not pl.saved:
                    continue
                if pl.whole:
                    shard.ranges[pl.name] = (seg.lo, seg.hi)
                else:
                    shard.ranges[pl.name] = pl.range
                    if (seg.lo, seg.hi) != (0, b.numels[seg.index]):
                        shard.windows[pl.name] = (seg.lo, seg.hi)
                shard.params[pl.name] = b.shard[seg.shard_lo:seg.shard_hi]
        for pl in self._whole():
            shard.shapes[pl.name] = pl.shape
            if self.group.rank == 0 and pl.saved and pl.tensor.numel():
                shard.ranges[pl.name] = pl.range
                shard.params[pl.name] = pl.tensor.detach().reshape(-1)
        return shard

    def saved_gradients(self) -> list[Tensor]:
        """The parts of the gradient shards this rank counts in the global norm: every shard, but where a
        placement is not ``saved`` (another rank of the inner mode holds the same elements) only the segments
        of those that are."""
        out: list[Tensor] = []
        for b in self.buckets:
            if all(self._placed[id(p)].saved for p in b.params):
                out.append(b.shard_grad)
                continue
            out.extend(b.shard_grad[seg.shard_lo:seg.shard_hi] for seg in b.segments
                       if self._placed[id(b.params[seg.index])].saved)
        return out

    def extra_repr(self) -> str:
        units = f", units={len(self.units)}" if self.stage == 3 else ""
        return (f"stage={self.stage}, group={self.group.backend} rank {self.group.rank}/{self.group.size}, "
                f"buckets={len(self.buckets)}{units}")


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


__all__ = ["DEFAULT_BUCKET_CAP_MB", "STAGES", "Unit", "ZeroModel"]
