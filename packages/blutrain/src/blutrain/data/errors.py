"""The exception hierarchy of blutrain.data.

Every message names the file or argument, what was expected and what was received. Each class also
subclasses the builtin a Python user would catch (``ValueError``, ``RuntimeError``), so
``except ValueError`` keeps working. The module depends on nothing but the standard library.
"""

from __future__ import annotations


class DataError(Exception):
    """Base of every error raised by blutrain.data."""


class ShardError(DataError, ValueError):
    """A token shard is malformed, or tokens cannot be stored in one."""


class LoaderError(DataError, ValueError):
    """A TokenLoader's arguments, shards or saved state do not fit together."""


class TokenizerError(DataError, ValueError):
    """An unknown tokenizer name, or a BPE ranks file that cannot be GPT-2's."""


class TokenizerUnavailableError(DataError, RuntimeError):
    """The files a tokenizer needs are not on this machine (BluTrain never downloads them)."""


class PrepareError(DataError, ValueError):
    """Input text or output directory that `prepare` cannot use."""


class CorpusError(DataError, RuntimeError):
    """The built-in corpus cannot be built or its cache is damaged."""
