"""The compiler's exceptions: one hierarchy, messages a user can act on."""

from __future__ import annotations


class CompilerError(Exception):
    """Base class of every error the compiler raises."""


class TracingError(CompilerError):
    """The function cannot be traced as it is (an unsupported array operation, a changed op sequence)."""


class DataDependentError(TracingError):
    """The traced function reads a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``):
    Python control flow that depends on data cannot be captured in a static graph."""


class GraphBreakError(TracingError):
    """A later call of a compiled function took a different sequence of ops than the traced one."""


__all__ = ["CompilerError", "DataDependentError", "GraphBreakError", "TracingError"]
