"""AdamW: Adam with decoupled weight decay, updated by one multi-tensor kernel per (device, dtype)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from blutrain.autograd import no_grad
from blutrain.optim import (
    Optimizer,
    OptimizerError,
    ParamGroup,
    Params,
    StepScalars,
    multi_tensor_apply,
    weight_decay_groups,
)
from blutrain.optim.multi_tensor import group_by_device_dtype
from blutrain.tensor import Tensor, capture, zeros_like
from blutrain_optim_adamw.kernel import adamw_step_scalars

KERNEL = "adamw_multi_tensor"


class AdamW(Optimizer):
    """AdamW with PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01) and
    PyTorch's update rule, including bias correction.

    Given plain parameters (not groups), it builds nanoGPT's groups: ``weight_decay`` on tensors of
    two or more dims (linear weights and embeddings), none on biases and LayerNorm parameters.
    Given groups, it uses them as they are. Each step is one ``adamw_multi_tensor`` kernel call per
    (device, dtype, step count) bucket of a group, under ``no_grad``; the call's learning rate and bias
    corrections live in device memory (:class:`~blutrain.optim.StepScalars`), so a compiled step
    replays one captured graph while they change.
    """

    state_like_param = ("exp_avg", "exp_avg_sq")
    # nanoGPT's betas for language-model training (a faster-moving second moment than PyTorch's default)
    trainer_defaults: ClassVar[Mapping[str, Any]] = {"betas": (0.9, 0.95)}

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.check_hyperparameters(defaults)
        items: list[Any] = [params] if isinstance(params, Tensor) else list(params)
        if items and all(isinstance(p, Tensor) for p in items):
            items = weight_decay_groups(items, weight_decay)
        super().__init__(items, defaults)
        self.step_scalars = StepScalars()

    def check_hyperparameters(self, group: ParamGroup) -> None:
        super().check_hyperparameters(group)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
                not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise OptimizerError(f"AdamW: betas must be two numbers in [0, 1), got {betas!r}")
        if not isinstance(group["eps"], (int, float)) or group["eps"] < 0:
            raise OptimizerError(f"AdamW: eps must be a number >= 0, got {group['eps']!r}")
        if not isinstance(group["weight_decay"], (int, float)) or group["weight_decay"] < 0:
            raise OptimizerError(f"AdamW: weight_decay must be a number >= 0, got {group['weight_decay']!r}")

    def step(self) -> None:
        with no_grad():
            for gi, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                guard = functools.partial(self._kernel_arguments, group, params)
                before = guard()  # at the start of the step: a compiled replay compares it with the traced one
                for p in params:
                    if p not in self.state:
                        self.state[p] = {"step": 0, "exp_avg": zeros_like(p), "exp_avg_sq": zeros_like(p)}
                beta1, beta2 = group["betas"]
                # Tensors that joined later have taken fewer steps (their own bias correction).
                buckets: dict[Any, list[Tensor]] = {}
                for key, idx in group_by_device_dtype(params).items():
                    for i in idx:
                        buckets.setdefault((*key, self.state[params[i]]["step"]), []).append(params[i])
                for k, ((device, _, _), ps) in enumerate(buckets.items()):
                    states = [self.state[p] for p in ps]
                    lists: list[Any] = [ps, [p.grad for p in ps], [s["exp_avg"] for s in states],
                                        [s["exp_avg_sq"] for s in states]]
                    advance = functools.partial(self._advance, group, states, (gi, k), device)
                    scalars = capture.per_call(advance, guard, before)
                    multi_tensor_apply(
                        KERNEL, lists, scalars, float(beta1), float(beta2), float(group["eps"]),
                        float(group["weight_decay"]), written=(0, 2, 3))

    def _advance(self, group: ParamGroup, states: list[dict[str, Any]], site: tuple[int, int], device: Any) -> Any:
        """A bucket's host work of one step, which a compiled replay repeats: the step counts, then the
        learning rate and bias corrections written into the bucket's device scalars."""
        for st in states:
            st["step"] += 1
        beta1, beta2 = group["betas"]
        values = adamw_step_scalars(float(group["lr"]), float(beta1), float(beta2), int(states[0]["step"]))
        return self.step_scalars(site, device, values)

    def _kernel_arguments(self, group: ParamGroup, params: list[Tensor]) -> tuple[Any, ...]:
        """What the step's kernels take as plain arguments, and whether every parameter had its state (a
        step that creates state runs other kernels)."""
        return (tuple(group["betas"]), group["eps"], group["weight_decay"], all(p in self.state for p in params))


__all__ = ["AdamW"]
