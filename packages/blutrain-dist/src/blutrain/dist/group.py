"""The process's default group: ``init_process_group`` and friends.

``init_process_group(backend)`` reads rank and world (:mod:`blutrain.dist.env`), connects to the
rendezvous store where there is one, and calls the factory the backend's plugin registered through
``blutrain_register_comm_backends``. The store is the launcher's (``blutrain run``), else one hosted
by rank 0 at ``MASTER_ADDR:MASTER_PORT``; MPI launched by mpirun needs none.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from blutrain.dist.env import DistEnv, detect
from blutrain.dist.errors import DistArgumentError, DistError
from blutrain.dist.process_group import ProcessGroup
from blutrain.dist.registry import comm_backends
from blutrain.dist.store import Store, StoreServer, TCPStore


class _Default:
    group: ProcessGroup | None = None
    store: Store | None = None
    server: StoreServer | None = None
    env: DistEnv | None = None
    before_destroy: list[weakref.ref[Callable[[], None]]] = []


_default = _Default()


def before_destroy(callback: Callable[[], None]) -> None:
    """Run ``callback`` once, before the default group is next destroyed. Held weakly (a bound method through
    ``weakref.WeakMethod``): registering keeps nothing alive, and a callback whose object is gone is skipped.

    What it is for: NCCL waits, in destroying a communicator, for every CUDA graph that captured one of its
    collectives, so whatever holds such a graph (a compiled parallel training step) registers its release here,
    and ``destroy_process_group`` cannot hang on a graph its caller forgot."""
    ref: weakref.ref[Callable[[], None]] = (weakref.WeakMethod(callback) if inspect.ismethod(callback)
                                            else weakref.ref(callback))
    _default.before_destroy.append(ref)


def default_comm_backend(device: str) -> str:
    """The comm backend ranks on ``device`` (a device type, or a device such as "cuda:1") use unless told
    otherwise: what its backend declares (``Backend.comm_backend``)."""
    from blutrain.tensor import backends

    kind = device.partition(":")[0]
    registry = backends()
    if kind not in registry.names():
        raise DistArgumentError(f"default_comm_backend: no device type {kind!r}; installed: "
                                f"{', '.join(registry.names())}")
    return registry.get(kind).comm_backend


def _default_backend() -> str:
    """The default device's comm backend where it is installed, else the host's."""
    from blutrain.tensor import default_device

    name = default_comm_backend(default_device())
    return name if name in comm_backends() else default_comm_backend("cpu")


def _connect_store(env: DistEnv) -> Store | None:
    if env.store_addr:
        host, _, port = env.store_addr.rpartition(":")
        return TCPStore(host, int(port), timeout=env.timeout)
    if env.master_addr is not None and env.master_port is not None:
        if env.rank == 0:
            _default.server = StoreServer("0.0.0.0", env.master_port).start()
        return TCPStore(env.master_addr, env.master_port, timeout=env.timeout)
    return None


def init_process_group(backend: str | None = None, *, timeout: float | None = None,
                       environ: dict[str, str] | None = None, **options: Any) -> ProcessGroup:
    """Create the default group of every rank of this job and return it.

    ``backend``: a registered comm backend ("mpi", "nccl", ...; default: the one the default device's backend
    declares, where it is installed, else the host's). ``timeout`` (seconds) bounds every operation of the group
    (default ``BLUTRAIN_DIST_TIMEOUT`` or 1800). ``options`` go to the backend's factory.
    """
    if _default.group is not None:
        raise DistError(f"init_process_group: already initialized (backend {_default.group.backend!r}, rank "
                        f"{_default.group.rank} of {_default.group.size}); call destroy_process_group() first")
    env = detect(environ)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise DistArgumentError(f"init_process_group: timeout must be a number of seconds > 0, got {timeout!r}")
        env = DistEnv(**{**env.__dict__, "timeout": float(timeout)})
    name = _default_backend() if backend is None else backend
    factory = comm_backends().get(name)
    store = _connect_store(env)
    group: ProcessGroup = factory(rank=env.rank, world_size=env.world_size, store=store, timeout=env.timeout,
                                  env=env, **options)
    _default.group, _default.store, _default.env = group, store, env
    return group


def is_initialized() -> bool:
    return _default.group is not None


def get_process_group() -> ProcessGroup:
    """The default group; an error if ``init_process_group`` was not called."""
    if _default.group is None:
        raise DistError("no process group: call blutrain.dist.init_process_group(backend=...) first")
    return _default.group


def get_store() -> Store | None:
    """The rendezvous store of the default group (None for a backend that needed none)."""
    return _default.store


def get_rank() -> int:
    return 0 if _default.group is None else _default.group.rank


def get_world_size() -> int:
    return 1 if _default.group is None else _default.group.size


def destroy_process_group() -> None:
    """Release the default group and its store; ``init_process_group`` may be called again. The callbacks of
    :func:`before_destroy` run first, in the order they were registered."""
    callbacks, _default.before_destroy = _default.before_destroy, []
    for ref in callbacks:
        callback = ref()
        if callback is not None:
            callback()
    group, _default.group = _default.group, None
    if group is not None:
        group.destroy()
    if isinstance(_default.store, TCPStore):
        _default.store.close()
    _default.store = None
    if _default.server is not None:
        _default.server.close()
        _default.server = None


__all__ = ["before_destroy", "default_comm_backend", "destroy_process_group", "get_process_group", "get_rank", "get_store", "get_world_size",
           "init_process_group", "is_initialized"]
