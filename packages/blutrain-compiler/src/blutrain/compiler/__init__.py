"""blutrain.compiler: whole-step compilation.

``compile(step)`` traces forward, backward and the optimizer's update into one graph in the
``blutrain`` MLIR dialect (xDSL), runs passes (DCE, CSE, GEMM-epilogue and elementwise fusion, kernel
selection, in-place analysis, memory planning) and replays the step as a flat list of launches through the
device's compile target: on the CPU with generated NumPy for fused regions (built in), on CUDA as one CUDA graph
with generated CUDA kernels (the target blutrain-backend-cupy registers). The compiler imports no device library.
"""

from blutrain.compiler.compile import CompiledFunction, CompileStats, compile, run_pipeline
from blutrain.compiler.dialect import BLUTRAIN, parse
from blutrain.compiler.errors import CompilerError, DataDependentError, GraphBreakError, TracingError
from blutrain.compiler.graph import trace_module
from blutrain.compiler.passes import DEFAULT_PIPELINE
from blutrain.compiler.registry import PassRegistry, passes
from blutrain.compiler.target import CompileTarget, CompileTargetRegistry, Executor, compile_target, compile_targets

__all__ = ["BLUTRAIN", "DEFAULT_PIPELINE", "CompileStats", "CompileTarget", "CompileTargetRegistry", "CompiledFunction",
           "CompilerError", "DataDependentError", "Executor", "GraphBreakError", "PassRegistry", "TracingError",
           "compile", "compile_target", "compile_targets", "parse", "passes", "run_pipeline", "trace_module"]
