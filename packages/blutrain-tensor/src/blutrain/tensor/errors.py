"""The exception hierarchy of blutrain-tensor.

Every error BluTrain raises about a tensor names the argument, what was expected and what was
received. The classes subclass the builtin that a Python user would catch (TypeError, ValueError,
RuntimeError, LookupError), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class BluTrainError(Exception):
    """Base of every error raised by BluTrain packages."""


class PluginError(BluTrainError, RuntimeError):
    """A plugin could not be loaded, or registered something inconsistent."""


class NotRegisteredError(BluTrainError, LookupError):
    """A lookup in a registry failed; the message lists what is installed."""


class TensorTypeError(BluTrainError, TypeError):
    """An argument has the wrong Python type or dtype."""


class ShapeError(BluTrainError, ValueError):
    """Shapes do not fit together; the message shows every shape involved."""


class TensorValueError(BluTrainError, ValueError):
    """An argument has a value outside what the op accepts."""


class DeviceMismatchError(BluTrainError, RuntimeError):
    """Tensors on different devices met in one op; the message shows both devices."""


class TensorIndexError(BluTrainError, IndexError):
    """An index is out of range for the dimension it indexes; the message shows index and size."""


class KernelNotFoundError(NotRegisteredError):
    """No kernel is registered for an (op, device, dtype); the message lists the providers."""


class AutogradError(BluTrainError, RuntimeError):
    """Misuse of the autograd graph (backward twice, in-place after save, ...)."""


class SerializationError(BluTrainError, ValueError):
    """A safetensors file is malformed, unreadable or unwritable, or does not hold what was asked for; the
    message names the file and what is wrong. Nothing else escapes the readers of
    :mod:`blutrain.tensor.serialization`, whatever bytes the file holds."""
