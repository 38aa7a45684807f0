"""The contract every communication backend implements, and the argument checks they share.

A :class:`ProcessGroup` is a set of ranks that run collectives together (ChainerMN's communicator:
one class per backend behind this small interface, chosen by name). Tensors are BluTrain tensors;
results are written in place, as torch.distributed does. ``async_op=True`` returns a :class:`Work`
whose ``wait()`` completes the operation; otherwise the call returns ``None`` once the result is
usable (on a GPU: ordered before later work on the current stream, not necessarily finished).

Every operation has a timeout (the group's); past it, every rank raises
:class:`~blutrain.dist.errors.CollectiveTimeoutError` instead of hanging, and the group is unusable.

A backend calls the shared checks below before compute; :func:`check_tensor` also refuses a
collective called while ``blutrain.compiler`` traces the calling thread (a compiled replay would skip
it). Collectives compile only through a group a caller declared for it: :func:`blutrain.dist.traceable`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from blutrain.tensor import Tensor, capture

from blutrain.dist.errors import DistArgumentError

ReduceOp = Literal["sum", "avg", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


@runtime_checkable
class Work(Protocol):
    """An operation in flight (``async_op=True``)."""

    def wait(self) -> None:
        """Block until the result can be used (raises CollectiveTimeoutError past the timeout)."""

    def is_completed(self) -> bool: ...


@runtime_checkable
class ProcessGroup(Protocol):
    """Ranks ``0..size-1`` of one communicator; ``backend`` is the registered name ("mpi", "nccl")."""

    rank: int
    size: int
    backend: str
    timeout: float

    def all_reduce(self, tensor: Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over all ranks; every rank gets the result in place."""

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = "sum",
                       async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size * output.shape[0]`` rows) over ranks; rank r gets rows block r."""

    def all_gather_into_tensor(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input`` along dim 0 into ``output``."""

    def all_gather(self, outputs: list[Tensor], input: Tensor, async_op: bool = False) -> Work | None:
        """``outputs[r]`` receives rank r's ``input``."""

    def broadcast(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        """Every rank's ``tensor`` becomes rank ``src``'s."""

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        """Block r of ``input`` (dim 0 split in ``size`` equal parts) goes to rank r; block s of
        ``output`` comes from rank s."""

    def send(self, tensor: Tensor, dst: int, async_op: bool = False) -> Work | None: ...

    def recv(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None: ...

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    def split(self, color: int, key: int) -> ProcessGroup:
        """A new group of the ranks that passed the same ``color``, ordered by ``key``. Collective
        over this group: every rank calls it, in the same order relative to other collectives."""

    def destroy(self) -> None:
        """Release the communicator; the group cannot be used afterwards."""


class CompletedWork:
    """The handle of an operation that finished before the call returned."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


# ---------------------------------------------------------------------------------- shared checks
# Backends call these before compute, so every backend reports a misuse in the same words.


def _desc(t: Tensor) -> str:
    return f"shape {list(t.shape)}, dtype {t.dtype.name}, device {t.device}"


def check_not_captured(op: str) -> None:
    """Refuse a collective of a plain group while a compiler trace is active on this thread: it would run
    while the function is traced and be skipped by every compiled call after. (A group made by
    :func:`blutrain.dist.traceable` hands its collectives to the trace instead, with the trace paused,
    so they never reach this check inside one.)"""
    found = capture.active()
    if found is not None:
        found.refuse(f"the collective {op}")


def check_tensor(op: str, argument: str, t: object, device_type: str) -> Tensor:
    check_not_captured(op)
    if not isinstance(t, Tensor):
        raise DistArgumentError(f"{op}: {argument} must be a blutrain Tensor, got {type(t).__name__}")
    if t.device.type != device_type:
        raise DistArgumentError(f"{op}: {argument} must be on a {device_type!r} device for this backend, got "
                                f"{t.device}")
    return t


def check_op(op_name: str, op: str, t: Tensor) -> None:
    if op not in REDUCE_OPS:
        raise DistArgumentError(f"{op_name}: op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    if op == "avg" and not t.dtype.is_floating:
        raise DistArgumentError(f"{op_name}: op 'avg' needs a floating tensor, got dtype {t.dtype.name}")


def check_rank(op: str, argument: str, rank: object, size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise DistArgumentError(f"{op}: {argument} must be a rank in 0..{size - 1}, got {rank!r}")
    return rank


def check_same(op: str, output: Tensor, input: Tensor, out_shape: tuple[int, ...]) -> None:
    """``output`` must have ``input``'s dtype and the shape ``out_shape``."""
    if output.dtype is not input.dtype:
        raise DistArgumentError(f"{op}: output and input must have one dtype, got output {output.dtype.name} "
                                f"and input {input.dtype.name}")
    if tuple(output.shape) != out_shape:
        raise DistArgumentError(f"{op}: output must have shape {list(out_shape)} for input of {_desc(input)}, got "
                                f"{list(output.shape)}")


def gathered_shape(op: str, input: Tensor, size: int) -> tuple[int, ...]:
    if input.ndim == 0:
        raise DistArgumentError(f"{op}: input must have at least one dimension, got a 0-d tensor")
    return (input.shape[0] * size, *input.shape[1:])


def scattered_shape(op: str, input: Tensor, size: int) -> tuple[int, ...]:
    if input.ndim == 0 or input.shape[0] % size:
        raise DistArgumentError(f"{op}: input's dim 0 must be a multiple of the group size {size}, got "
                                f"{_desc(input)}")
    return (input.shape[0] // size, *input.shape[1:])


def check_list(op: str, outputs: Any, input: Tensor, size: int, device_type: str) -> list[Tensor]:
    if not isinstance(outputs, list) or len(outputs) != size:
        got = f"a list of {len(outputs)}" if isinstance(outputs, list) else type(outputs).__name__
        raise DistArgumentError(f"{op}: outputs must be a list of {size} tensors (one per rank), got {got}")
    for i, t in enumerate(outputs):
        check_tensor(op, f"outputs[{i}]", t, device_type)
        check_same(op, t, input, tuple(input.shape))
    return outputs


__all__ = ["REDUCE_OPS", "CompletedWork", "ProcessGroup", "ReduceOp", "Work", "check_list", "check_not_captured",
           "check_op", "check_rank", "check_same", "check_tensor", "gathered_shape", "scattered_shape"]
