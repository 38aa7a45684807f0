"""SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, as PyTorch defines them."""

from __future__ import annotations

import functools
from typing import Any

from blutrain.autograd import no_grad
from blutrain.optim import Optimizer, OptimizerError, ParamGroup, Params, StepScalars, multi_tensor_apply
from blutrain.optim.multi_tensor import group_by_device_dtype
from blutrain.tensor import Tensor, capture, zeros_like

KERNEL = "sgd_multi_tensor"


class SGD(Optimizer):
    """Stochastic gradient descent: lr (default 1e-3), momentum, dampening, weight_decay (added to
    the gradient, L2 style), nesterov (needs momentum > 0 and dampening 0). Each step is one
    ``sgd_multi_tensor`` kernel call per (device, dtype) bucket of a group, under ``no_grad``; the
    learning rate reaches it in device memory (:class:`~blutrain.optim.StepScalars`), so a compiled
    step replays one captured graph under a schedule."""

    state_like_param = ("momentum_buffer",)

    def __init__(self, params: Params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov}
        super().__init__(params, defaults)
        self.step_scalars = StepScalars()

    def check_hyperparameters(self, group: ParamGroup) -> None:
        super().check_hyperparameters(group)
        for name in ("momentum", "dampening", "weight_decay"):
            value = group[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise OptimizerError(f"SGD: {name} must be a number >= 0, got {value!r}")
        if not isinstance(group["nesterov"], bool):
            raise OptimizerError(f"SGD: nesterov must be a bool, got {group['nesterov']!r}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise OptimizerError(f"SGD: nesterov needs momentum > 0 and dampening 0, got momentum "
                                 f"{group['momentum']} and dampening {group['dampening']}")

    def step(self) -> None:
        with no_grad():
            for gi, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                guard = functools.partial(self._kernel_arguments, group, params)
                before = guard()  # at the start of the step: a compiled replay compares it with the traced one
                momentum = float(group["momentum"])
                for idx in group_by_device_dtype(params).values():
                    bucket = [params[i] for i in idx]
                    # every call of the group on this device reads the group's lr from one array; a compiled
                    # replay writes it again (capture.per_call)
                    site, device = (gi, bucket[0].device), bucket[0].device
                    refill = functools.partial(self._learning_rate, group, site, device)
                    lr = capture.per_call(refill, guard, before)
                    if momentum == 0.0:
                        self._apply(group, lr, bucket, [], first=False)
                        continue
                    # Buffers are created on a tensor's first step (b ← d), so new and old tensors
                    # go to separate calls.
                    new = [p for p in bucket if p not in self.state]
                    old = [p for p in bucket if p in self.state]
                    for p in new:
                        self.state[p] = {"momentum_buffer": zeros_like(p)}
                    for part, first in ((old, False), (new, True)):
                        if part:
                            self._apply(group, lr, part, [self.state[p]["momentum_buffer"] for p in part], first)

    def _learning_rate(self, group: ParamGroup, site: tuple[int, Any], device: Any) -> Any:
        return self.step_scalars(site, device, (float(group["lr"]),))

    def _kernel_arguments(self, group: ParamGroup, params: list[Tensor]) -> tuple[Any, ...]:
        """What the step's kernels take as plain arguments, and whether every parameter had its buffer (a
        first step of a buffer runs another kernel call)."""
        return (group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"],
                all(p in self.state for p in params))

    def _apply(self, group: ParamGroup, lr: Any, params: list[Tensor], buffers: list[Tensor], first: bool) -> None:
        lists: list[Any] = [params, [p.grad for p in params], buffers]
        multi_tensor_apply(KERNEL, lists, lr, float(group["momentum"]),
                           float(group["dampening"]), float(group["weight_decay"]), bool(group["nesterov"]),
                           first,
                           written=(0, 2) if buffers else (0,))


__all__ = ["SGD"]
