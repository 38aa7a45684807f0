"""The built-in passes and the built-in compile target (NumPy, "cpu"): a plugin of ``blutrain_register_passes``
and ``blutrain_register_compile_targets`` like any other.

Each pass is an xDSL :class:`~xdsl.passes.ModulePass` with a ``name``; :data:`CORE_PIPELINE` is the order of these
generic passes, into which :func:`blutrain.compiler.default_pipeline` places the passes plugins register with a
place (an optimizer's pass beside its kernel). The pass modules import xDSL, so this module (loaded with every
plugin) imports them only when the hook is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blutrain.tensor.plugins import hookimpl

if TYPE_CHECKING:
    from blutrain.compiler.registry import PassRegistry
    from blutrain.compiler.target import CompileTargetRegistry

# Generic passes only: each matches ops of the catalogue (or the multi-tensor calls any optimizer makes), never one
# optimizer's or one model family's code.
CORE_PIPELINE: tuple[str, ...] = ("copy-elision", "inplace-aliasing", "dce", "cse", "dce", "layernorm-residual",
                                  "gemm-epilogue", "layernorm-grad-add", "layernorm-cast", "layernorm-grad-outputs",
                                  "embedding-grad-add", "elementwise-fusion", "multi-tensor-cast", "kernel-selection",
                                  "memory-plan")

# The rematerialization pass: not in CORE_PIPELINE (compile's ``remat=True`` places it), run before this core pass.
REMAT_PASS = "rematerialize"
REMAT_BEFORE = "kernel-selection"


@hookimpl
def blutrain_register_passes(registry: PassRegistry) -> None:
    from blutrain.compiler.passes.aliasing import InplaceAliasing
    from blutrain.compiler.passes.copy_elision import CopyElision
    from blutrain.compiler.passes.cse import CommonSubexpressionElimination
    from blutrain.compiler.passes.dce import DeadCodeElimination
    from blutrain.compiler.passes.emb_grad import EmbeddingGradAdd
    from blutrain.compiler.passes.epilogue import GemmEpilogueFusion
    from blutrain.compiler.passes.fusion import ElementwiseFusion
    from blutrain.compiler.passes.memory import MemoryPlan
    from blutrain.compiler.passes.multi_cast import MultiTensorCast
    from blutrain.compiler.passes.norm_cast import LayerNormCast
    from blutrain.compiler.passes.norm_grad import LayerNormGradAdd
    from blutrain.compiler.passes.norm_grad_out import LayerNormGradOutputs
    from blutrain.compiler.passes.norm_residual import LayerNormResidual, LayerNormResidualLinearAdd
    from blutrain.compiler.passes.remat import Rematerialize, RematerializeActivations
    from blutrain.compiler.passes.select import KernelSelection

    for p in (CopyElision, InplaceAliasing, DeadCodeElimination, CommonSubexpressionElimination, GemmEpilogueFusion,
              EmbeddingGradAdd, LayerNormGradAdd, LayerNormCast, LayerNormGradOutputs, ElementwiseFusion,
              KernelSelection, MemoryPlan,
              MultiTensorCast, LayerNormResidual, LayerNormResidualLinearAdd, Rematerialize, RematerializeActivations):
        registry.register(p.name, p)


@hookimpl
def blutrain_register_compile_targets(registry: CompileTargetRegistry) -> None:
    from blutrain.compiler.codegen_numpy import TARGET

    registry.register(TARGET.device, TARGET)


__all__ = ["CORE_PIPELINE", "REMAT_BEFORE", "REMAT_PASS", "blutrain_register_compile_targets",
           "blutrain_register_passes"]
