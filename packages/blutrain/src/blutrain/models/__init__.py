"""blutrain.models: model families as plugins, and the built-in GPT-2.

A family registers a :class:`ModelSpec` through ``blutrain_register_models``; :func:`models` lists what
is installed and :func:`model_spec` finds one by name. ``blutrain.models.gpt2`` is the built-in family.
"""

from blutrain.models.errors import ModelError, PretrainedError
from blutrain.models.gpt2 import GPT2, PRESETS, GPT2Config
from blutrain.models.parallel_plan import (
    ModelParallelPlan,
    PlannedAttention,
    RewrittenModel,
    head_logits,
    module_at,
    plan_of,
    replace_module,
    require_plan,
    token_loss_sum,
    unwrapped,
)
from blutrain.models.registry import DEFAULT_MODEL, ModelRegistry, model_spec, models
from blutrain.models.spec import (
    ConfigClass,
    HFMapping,
    Model,
    ModelClass,
    ModelConfig,
    ModelSpec,
    check_token_ids,
)

__all__ = ["DEFAULT_MODEL", "GPT2", "PRESETS", "ConfigClass", "GPT2Config", "HFMapping", "Model", "ModelClass",
           "ModelConfig", "ModelError", "ModelParallelPlan", "ModelRegistry", "ModelSpec", "PlannedAttention",
           "PretrainedError", "RewrittenModel", "check_token_ids", "head_logits", "model_spec", "models", "module_at",
           "plan_of", "replace_module", "require_plan", "token_loss_sum", "unwrapped"]
