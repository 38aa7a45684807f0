"""The trainer's compiled step (--compile, clip > 0, AdamW): the compiler's adamw-grad-scale pass hands the
global-norm clip's rescale to the AdamW calls, so no pass over the gradients is left for it."""

from __future__ import annotations

import io
from collections.abc import Callable

from blutrain.compiler.dialect import Operand, decode, is_kernel, kernel_name
from blutrain.compiler.graph import body
from blutrain.train import TrainConfig, Trainer

MakeConfig = Callable[..., TrainConfig]


def test_the_compiled_step_scales_the_gradients_inside_adamw(make_config: MakeConfig) -> None:
    cfg = make_config(compile=True, max_steps=3)
    cfg.model_overrides["dropout"] = 0.0  # the compiler traces no dropout
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.run()
    ops = [o for o in body(trainer.compiled_step.last.module).ops if is_kernel(o)]
    adamws = [o for o in ops if kernel_name(o) == "adamw_multi_tensor"]
    assert len(adamws) == 2  # decayed and undecayed groups
    assert not any(kernel_name(o) == "scale_multi_tensor" for o in ops)
    for o in adamws:
        assert decode(o.properties["args"])[9:] == (Operand(len(o.operands) - 1),)
