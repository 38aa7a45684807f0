"""blutrain.compiler: whole-step compilation. This release defines the pass hook specification and
registry; the tracer, dialect, passes and executor land with the compiler issue."""

from blutrain.compiler.registry import PassRegistry, passes

__all__ = ["PassRegistry", "passes"]
