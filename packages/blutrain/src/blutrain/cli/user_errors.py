"""What the ``blutrain`` command reports as a user's mistake: one line on stderr, no traceback, a non-zero exit.

A user error is an exception of one of the project's error hierarchies (each package has one; see
``USER_ERROR_CLASSES``), a BluTrain package that is not installed, or an interrupt. Anything else is a bug
and keeps its traceback. A hierarchy is looked up only where its module is already imported: an error of a
package that was never imported cannot have been raised, and the command's start stays cheap.
"""

from __future__ import annotations

import signal
import sys

# (module, class): the base of each package's hierarchy that does not derive from BluTrainError
USER_ERROR_CLASSES: tuple[tuple[str, str], ...] = (
    ("blutrain.tensor.errors", "BluTrainError"),
    ("blutrain.data.errors", "DataError"),
    ("blutrain.alloc.errors", "AllocatorError"),
    ("blutrain.compiler.errors", "CompilerError"),
)

# the distributions of the ``blutrain`` namespace that a command may import
_DISTRIBUTIONS = ("tensor", "autograd", "kernels", "alloc", "dist", "compiler")


def _classes() -> tuple[type[BaseException], ...]:
    found = []
    for module_name, class_name in USER_ERROR_CLASSES:
        module = sys.modules.get(module_name)
        if module is not None:
            found.append(getattr(module, class_name))
    return tuple(found)


def missing_distribution(exc: ModuleNotFoundError) -> str | None:
    """The BluTrain distribution whose absence ``exc`` reports (``blutrain.autograd`` → blutrain-autograd),
    or None where the missing module is not one of the project's."""
    name = exc.name or ""
    parts = name.split(".")
    if parts[0] != "blutrain" or len(parts) < 2:
        return None
    return f"blutrain-{parts[1]}" if parts[1] in _DISTRIBUTIONS else "blutrain"


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message for a user error, or None when ``exc`` is a bug (its traceback is wanted)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, ModuleNotFoundError):
        dist = missing_distribution(exc)
        if dist is None:
            return None
        return f"this command needs the {dist} package, which is not installed (No module named {exc.name!r}); " \
               f"install it: pip install {dist}"
    if isinstance(exc, _classes()):
        return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line
    return None


def exit_status(exc: BaseException) -> int:
    """The exit status for a user error: 128 + the signal for an interrupt (130 for SIGINT, 143 for
    SIGTERM, as a shell reports a process the signal stopped), else 1."""
    interrupted = sys.modules.get("blutrain.train.errors")
    if interrupted is not None and isinstance(exc, interrupted.TrainInterruptedError):
        return 128 + int(exc.signal_number)
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


__all__ = ["USER_ERROR_CLASSES", "exit_status", "missing_distribution", "user_error_message"]
