"""blutrain.optim: the optimizer contract, registry, LR schedules and gradient clipping.

Optimizers themselves are plugins (``blutrain-optim-adamw``, ``blutrain-optim-sgd``, or yours):
they register a class through ``blutrain_register_optimizers`` and are built by name with
:func:`create`.
"""

from blutrain.optim.clip import clip_grad_norm_, global_norm, scale_
from blutrain.optim.errors import OptimizerError
from blutrain.optim.groups import weight_decay_groups
from blutrain.optim.multi_tensor import StepScalars, group_by_device_dtype, multi_tensor_apply
from blutrain.optim.optimizer import Optimizer, OptimizerProtocol, ParamGroup, Params
from blutrain.optim.registry import OptimizerRegistry, create, optimizers
from blutrain.optim.schedule import constant, warmup_cosine

__all__ = ["Optimizer", "OptimizerError", "OptimizerProtocol", "OptimizerRegistry", "ParamGroup", "Params",
           "StepScalars", "clip_grad_norm_", "constant", "create", "global_norm", "group_by_device_dtype",
           "multi_tensor_apply", "optimizers", "scale_", "warmup_cosine", "weight_decay_groups"]
