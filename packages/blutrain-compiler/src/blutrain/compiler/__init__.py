"""blutrain.compiler: whole-step compilation.

``compile(step)`` traces forward, backward and the optimizer's update into one graph in the
``blutrain`` MLIR dialect (xDSL), runs passes (DCE, CSE, GEMM-epilogue and elementwise fusion, kernel
selection, in-place analysis, memory planning) and replays the step as a flat list of launches through the
device's compile target: on the CPU with generated NumPy for fused regions (built in), on CUDA as one CUDA graph
with generated CUDA kernels (the target blutrain-backend-cupy registers). The compiler imports no device library.
"""

from blutrain.compiler.compile import CompiledFunction, CompileStats, compile, run_pipeline
from blutrain.compiler.dialect import (
    BLUTRAIN,
    Operand,
    ViewOp,
    decode,
    encode,
    is_kernel,
    kernel_name,
    kernel_op_class,
    parse,
    type_info,
)
from blutrain.compiler.errors import CompilerError, DataDependentError, GraphBreakError, TracingError
from blutrain.compiler.graph import trace_module
from blutrain.compiler.passes import CORE_PIPELINE
from blutrain.compiler.passes.aliasing import written_operands
from blutrain.compiler.passes.patterns import Scan
from blutrain.compiler.registry import PassRegistry, default_pipeline, passes, with_remat
from blutrain.compiler.target import CompileTarget, CompileTargetRegistry, Executor, compile_target, compile_targets

# Operand, Scan, ViewOp, decode, encode, is_kernel, kernel_name, kernel_op_class, type_info and written_operands are
# what a pass (a plugin's too) reads and rewrites the blutrain dialect with.
__all__ = ["BLUTRAIN", "CORE_PIPELINE", "CompileStats", "CompileTarget", "CompileTargetRegistry", "CompiledFunction",
           "CompilerError", "DataDependentError", "Executor", "GraphBreakError", "Operand", "PassRegistry", "Scan",
           "TracingError", "ViewOp", "compile", "compile_target", "compile_targets", "decode", "default_pipeline",
           "encode", "is_kernel", "kernel_name", "kernel_op_class", "parse", "passes", "run_pipeline", "trace_module",
           "type_info", "with_remat", "written_operands"]
