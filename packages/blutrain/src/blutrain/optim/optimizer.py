"""The optimizer contract (a Protocol plugins implement) and a base class that does the bookkeeping.

An optimizer holds ``param_groups``, a list of dicts each with ``"params"`` (a list of tensors) and
its hyperparameters (``"lr"``, ``"weight_decay"``, ...), which a schedule may change between steps,
and per-parameter ``state``. :meth:`Optimizer.state_dict` names parameters by their position in
the groups (0, 1, ... in group order), so a checkpoint restores into a freshly built optimizer over
the same model exactly; it holds only tensors, numbers, strings, bools and lists, so it survives a
JSON + safetensors round trip (which turns int keys into strings and tuples into lists — both are
accepted back).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from blutrain.autograd import no_grad
from blutrain.optim.errors import OptimizerError
from blutrain.tensor import Tensor

ParamGroup = dict[str, Any]
Params = Iterable[Tensor] | Iterable[ParamGroup]


@runtime_checkable
class OptimizerProtocol(Protocol):
    """What ``blutrain.optim.create`` callers rely on; a plugin's class needs only this (subclassing
    :class:`Optimizer` is the easy way to get it). Constructed as ``cls(params, **hyperparameters)``.

    ``trainer_defaults``: the hyperparameters ``blutrain train`` passes beyond ``lr`` and the weight-decay
    groups, where a language model's training recipe wants other values than the constructor's general
    defaults (AdamW: nanoGPT's betas (0.9, 0.95) instead of PyTorch's (0.9, 0.999)); empty for none."""

    trainer_defaults: ClassVar[Mapping[str, Any]]
    param_groups: list[ParamGroup]

    def step(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Optimizer:
    """Base class: parameter groups with defaults filled in, per-parameter state, zero_grad and
    state dicts. Subclasses implement :meth:`step` (called under ``no_grad`` by convention: decorate
    or wrap it) and may override :meth:`check_hyperparameters`."""

    # State entries that must have the parameter's shape (checked by load_state_dict).
    state_like_param: tuple[str, ...] = ()
    # What the trainer passes beyond lr and the groups (see OptimizerProtocol): the constructor's defaults stand.
    trainer_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, params: Params, defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[ParamGroup] = []
        self.state: dict[Tensor, dict[str, Any]] = {}
        if isinstance(params, Tensor):
            raise OptimizerError(f"{type(self).__name__}: params must be an iterable of Tensors or of dicts, "
                                 "got a single Tensor; pass [tensor]")
        groups: list[Any] = list(params)
        if not groups:
            raise OptimizerError(f"{type(self).__name__}: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    # -- groups --------------------------------------------------------------------------------
    def add_param_group(self, group: ParamGroup) -> None:
        """Add a group; missing hyperparameters come from the defaults. A parameter may be in one
        group only."""
        name = type(self).__name__
        if not isinstance(group, dict) or "params" not in group:
            raise OptimizerError(f"{name}: a parameter group must be a dict with a 'params' entry, got "
                                 f"{group!r}")
        raw = group["params"]
        params = [raw] if isinstance(raw, Tensor) else list(raw)
        index = len(self.param_groups)
        for p in params:
            if not isinstance(p, Tensor):
                raise OptimizerError(f"{name}: group {index} holds a {type(p).__name__}; parameters must be "
                                     "Tensors")
            if not p.dtype.is_floating:
                raise OptimizerError(f"{name}: group {index} holds a tensor of dtype {p.dtype.name}; "
                                     "parameters must be floating")
            if not p.is_leaf:
                raise OptimizerError(f"{name}: group {index} holds a non-leaf tensor; optimize leaves "
                                     "(Parameters)")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params) or len({id(p) for p in params}) != len(params):
            raise OptimizerError(f"{name}: group {index} repeats a parameter that is already optimized; each "
                                 "parameter may appear once")
        new = {k: v for k, v in group.items() if k != "params"}
        for k, v in self.defaults.items():
            new.setdefault(k, v)
        self.check_hyperparameters(new)
        new["params"] = params
        self.param_groups.append(new)

    def check_hyperparameters(self, group: ParamGroup) -> None:
        """Raise OptimizerError for an invalid hyperparameter of ``group`` (subclasses extend)."""
        lr = group.get("lr")
        if lr is not None and (not isinstance(lr, (int, float)) or lr < 0):
            raise OptimizerError(f"{type(self).__name__}: lr must be a number >= 0, got {lr!r}")

    # -- the update ----------------------------------------------------------------------------
    def step(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's ``.grad`` (or zero it in place with ``set_to_none=False``)."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    with no_grad():
                        p.grad.detach().zero_()

    # -- checkpoints ---------------------------------------------------------------------------
    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [{hyperparameters..., "params": [index, ...]}]}``.

        State tensors are returned by reference (no copy): save or clone them before the next step.
        """
        index = {id(p): i for i, p in enumerate(self._all_params())}
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters and state saved by :meth:`state_dict` from an optimizer built the
        same way; tensors are copied onto each parameter's device (floating ones in its dtype)."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise OptimizerError(f"{name}.load_state_dict: expected a dict with 'state' and 'param_groups', "
                                 f"got {got}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise OptimizerError(f"{name}.load_state_dict: the state dict has {len(saved_groups)} parameter "
                                 f"groups, the optimizer has {len(self.param_groups)}")
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                n_saved, n_have = len(saved["params"]), len(group["params"])
                raise OptimizerError(f"{name}.load_state_dict: group {i} has {n_saved} parameters in the "
                                     f"state dict and {n_have} in the optimizer")
        params = self._all_params()
        new_state: dict[Tensor, dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            try:
                i = int(key)
                p = params[i]
            except (ValueError, IndexError):
                raise OptimizerError(f"{name}.load_state_dict: state key {key!r} is not the index of one of "
                                     f"the {len(params)} parameters") from None
            restored: dict[str, Any] = {}
            for k, v in entry.items():
                if isinstance(v, Tensor):
                    if k in self.state_like_param and v.shape != p.shape:
                        raise OptimizerError(f"{name}.load_state_dict: state '{k}' of parameter {i} has "
                                             f"shape {list(v.shape)}, the parameter has {list(p.shape)}")
                    cast = p.dtype if v.dtype.is_floating else None
                    v = v.detach().to(device=p.device, dtype=cast, copy=True)
                restored[k] = v
            new_state[p] = restored
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            self.check_hyperparameters({**group, **hyper})
            group.update(hyper)
        self.state = new_state

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            hyper = ", ".join(f"{k}={v}" for k, v in g.items() if k != "params")
            lines.append(f"  group {i}: {len(g['params'])} tensors, {hyper}")
        return "\n".join(lines) + "\n)"


__all__ = ["Optimizer", "OptimizerProtocol", "ParamGroup", "Params"]
