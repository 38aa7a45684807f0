"""ZeroOptimizer: any registered optimizer, stepping only this rank's shard of the parameters.

The wrapped optimizer's class is built again over one view per *segment* (the part of a parameter in
this rank's shard, see :mod:`blutrain_parallel_zero.flat`), each in the group its parameter was in,
with ``.grad`` the matching view of the shard's averaged gradient. Elementwise optimizers (AdamW,
SGD with momentum) then update exactly the elements a single process would, and hold state for 1/n
of them. Hyperparameters are read from the wrapped optimizer's ``param_groups`` at every step, so a
learning-rate schedule writes them where it always did.
"""

from __future__ import annotations

import math
from typing import Any

from blutrain.autograd import no_grad
from blutrain.dist import DistArgumentError, StateShard
from blutrain.tensor import Tensor, capture, clamp, norm, stack, zeros
from blutrain_parallel_zero.flat import FlatBucket, Segment
from blutrain_parallel_zero.model import ZeroModel


class ZeroOptimizer:
    """``optimizer`` (built over ``model.module``'s parameters) sharded as ``model`` shards them."""

    def __init__(self, optimizer: Any, model: ZeroModel) -> None:
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
            raise DistArgumentError(f"ZeroOptimizer: optimizer must have param_groups (a list of dicts with "
                                    f"'params'), got {type(optimizer).__name__}")
        if not isinstance(model, ZeroModel):
            raise DistArgumentError(f"ZeroOptimizer: model must be the ZeroModel the parameters were sharded by, "
                                    f"got {type(model).__name__}")
        self.optimizer = optimizer
        self.model = model
        self.param_groups: list[dict[str, Any]] = groups
        self._params: list[Tensor] = [p for g in groups for p in g["params"]]
        group_of: dict[int, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                model.parameter_name(p)  # raises for a tensor the model did not shard
                group_of[id(p)] = gi
        segs: list[list[Tensor]] = [[] for _ in groups]
        self._segments: list[tuple[FlatBucket, Segment, Tensor]] = []
        for b in model.buckets:
            for seg in b.segments:
                found = group_of.get(id(b.params[seg.index]))
                if found is None:
                    continue  # not optimized: the shard keeps its values
                gi = found
                view = b.shard[seg.shard_lo:seg.shard_hi]
                view.grad = b.shard_grad[seg.shard_lo:seg.shard_hi]
                segs[gi].append(view)
                self._segments.append((b, seg, view))
        inner_groups = [{**_hyper(g), "params": s} for g, s in zip(groups, segs, strict=True)]
        self.inner: Any = type(optimizer)(inner_groups)
        self._reduced = False

    # ----------------------------------------------------------------------------- gradients
    def _ready(self) -> None:
        if self.model.stage == 1 and not self._reduced:
            self.model.reduce_gradients()
        self._reduced = True

    def grad_norm(self) -> Tensor:
        """The L2 norm of the whole averaged gradient (a collective: every rank of the model's ``norm_group``
        calls it)."""
        self._ready()
        with no_grad():
            grads = self.model.saved_gradients()
            local = norm(stack([norm(g).to(dtype="float32") for g in grads])) if grads else zeros(())
            sq = local * local
            self.model.norm_group.all_reduce(sq, op="sum")
            return sq ** 0.5

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> Tensor:
        """As :func:`blutrain.optim.clip_grad_norm_` over the whole model: scale the gradient shards so
        that the global norm is at most ``max_norm``; returns the norm before clipping."""
        if not isinstance(max_norm, (int, float)) or not max_norm > 0 or not math.isfinite(max_norm):
            raise DistArgumentError(f"ZeroOptimizer.clip_grad_norm_: max_norm must be a finite number > 0, got "
                                    f"{max_norm!r}")
        total = self.grad_norm()
        with no_grad():
            coef = clamp(max_norm / (total + eps), max=1.0)
            for b in self.model.buckets:
                b.shard_grad.mul_(coef.to(dtype=b.dtype))
        return total

    # ----------------------------------------------------------------------------- the update
    def step(self) -> None:
        self._ready()
        # host work a compiled replay repeats too (before the inner optimizer's own): the trainer sets the
        # schedule's lr on the outer groups
        capture.per_call(self._copy_hyperparameters)  # no kernel argument: the inner optimizer guards its own
        self.inner.step()
        if self.model.stage < 3:  # gathered at the next forward (or read), beside it when compiled
            capture.per_call(self.model.mark_stale)

    def _copy_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update(_hyper(outer))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (and drop stage 1's local ``.grad``)."""
        with no_grad():
            for b in self.model.buckets:
                b.shard_grad.zero_()
        for p in self._params:
            p.grad = None
        self._reduced = False

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard, as :meth:`state_shard` (a layout and its pieces); merge the shards of
        every rank with :func:`blutrain.dist.merge_shards` for a single-process optimizer."""
        shard = self.state_shard()
        return {"sharded": shard.layout(), "params": shard.params, "state": shard.optimizer}

    def state_shard(self) -> StateShard:
        """The model's shard (:meth:`ZeroModel.state_shard`) with this rank's optimizer state and the
        parameter groups, parameters named."""
        shard = self.model.state_shard()
        for b, seg, view in self._segments:
            st = self.inner.state.get(view)
            name = b.names[seg.index]
            if st and name in shard.ranges:  # not where another rank saves the same elements
                shard.optimizer[name] = dict(st)
        shard.param_groups = [{**_hyper(g), "params": [self.model.parameter_name(p) for p in g["params"]]}
                              for g in self.param_groups]
        return shard

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's part of a whole optimizer state (``blutrain.optim``'s format: from a
        single-process run, DDP, or :func:`blutrain.dist.merge_shards`)."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise DistArgumentError(f"ZeroOptimizer.load_state_dict: expected a dict with 'state' and "
                                    f"'param_groups', got {got}")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups, strict=True)):
            raise DistArgumentError(
                "ZeroOptimizer.load_state_dict: the state dict's groups hold "
                f"{[len(s['params']) for s in saved]} parameters, the optimizer's "
                f"{[len(g['params']) for g in self.param_groups]}")
        index = {id(p): i for i, p in enumerate(self._params)}
        entries = {int(k): v for k, v in state_dict["state"].items()}
        new_state: dict[Tensor, dict[str, Any]] = {}
        with no_grad():
            for b, seg, view in self._segments:
                entry = entries.get(index[id(b.params[seg.index])])
                if entry is None:
                    continue
                part: dict[str, Any] = {}
                for k, v in entry.items():
                    if isinstance(v, Tensor) and tuple(v.shape) == b.shapes[seg.index]:
                        v = v.detach().to(device=b.device, dtype=b.dtype).reshape(-1)[seg.lo:seg.hi].clone()
                    part[k] = v
                new_state[view] = part
        for s, g, inner in zip(saved, self.param_groups, self.inner.param_groups, strict=True):
            hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in s.items() if k != "params"}
            g.update(hyper)
            inner.update(hyper)
        self.inner.state = new_state

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.model.stage}, {type(self.optimizer).__name__}, "
                f"{len(self._segments)} segments on rank {self.model.group.rank})")


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


__all__ = ["ZeroOptimizer"]
