"""The exception hierarchy of blutrain-dist.

Every error names the rank, the group and what was expected; they subclass the builtin a user would
catch (``TimeoutError``, ``RuntimeError``, ``ValueError``), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

from blutrain.tensor.errors import BluTrainError


class DistError(BluTrainError, RuntimeError):
    """Base of every error raised by blutrain.dist and the comm/parallel plugins."""


class DistArgumentError(DistError, ValueError):
    """A collective got tensors or arguments that do not fit (shape, dtype, device, rank)."""


class DistEnvironmentError(DistError):
    """Rank, world size or rendezvous address could not be read from the environment."""


class CollectiveTimeoutError(DistError, TimeoutError):
    """A collective or point-to-point operation did not complete within the group's timeout.

    The group is unusable afterwards: the other ranks may be dead, hung, or in another collective.
    """


class StoreError(DistError):
    """The key-value store could not be reached, or answered with an error."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A key did not appear in the store within the timeout."""


class LaunchError(DistError):
    """``blutrain run`` could not start its ranks, or a rank failed (the message names it)."""


__all__ = ["CollectiveTimeoutError", "DistArgumentError", "DistEnvironmentError", "DistError", "LaunchError",
           "StoreError", "StoreTimeoutError"]
