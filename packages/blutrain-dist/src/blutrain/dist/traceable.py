"""Collectives a compiled step may contain: a process group whose caller declared how they compose with
``blutrain.compiler``.

A compiled call replays the kernels its trace recorded; a collective is not a kernel. A plain group's
collective inside a traced function is therefore refused (:func:`check_not_captured`, with the line
that called it). ``traceable(group)`` is the declaration that the caller's collectives may be recorded
into the compiled step instead: while the compiler traces, each collective of the returned group is
handed to the trace, which runs it (synchronously) and records it as an op of the step; every later call
issues it through the real group at that place in the step. The compiled program lets the ops after it
that touch none of its buffers run beside it and joins it at the first op that does (on CUDA: a branch
of the step's one CUDA graph on a communication stream).

What the caller promises by declaring, and what a parallel mode checks before it does:

- the same collectives, in the same order, with the same arguments on every call (no choice made
  from ``Work.is_completed()`` or from values read on the host);
- nothing reads a collective's output, or writes its input, between issuing it and ``wait()`` (while
  tracing, ``async_op=True`` gets a completed :class:`~blutrain.dist.CompletedWork`: the compiled program
  finds the first op that touches the collective's buffers and orders it after the collective, so the
  overlap eager mode had is kept where the program order allows it); and no two operations must be in
  flight together (a ``send`` and the ``recv`` its peer posts at the same time would each wait for the
  other): a send paired with a recv goes through :meth:`TraceableGroup.sendrecv`
  (:func:`blutrain.dist.sendrecv`), which posts both and waits for both as one event;
- buffers a collective writes are made by kernels inside the function (``zeros``, not ``empty``, whose
  memory no kernel makes) or live outside it (parameters, gradient buckets).

Outside a trace every call goes straight to the wrapped group.
"""

from __future__ import annotations

from typing import Any

from blutrain.tensor import Tensor, capture

from blutrain.dist.coalesced import all_reduce_coalesced
from blutrain.dist.exchange import sendrecv
from blutrain.dist.process_group import CompletedWork, ProcessGroup, ReduceOp, Work, check_not_captured


class TraceableGroup:
    """``group`` with its collectives recordable by a compiler trace (see the module doc)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.rank, self.size, self.backend, self.timeout = group.rank, group.size, group.backend, group.timeout

    def __repr__(self) -> str:
        return f"traceable({self.group!r})"

    def _call(self, name: str, args: tuple[Any, ...], async_op: bool) -> Work | None:
        found = capture.active()
        method = getattr(self.group, name)
        if found is None:
            result: Work | None = method(*args, async_op=async_op)
            return result
        found.host_call(f"{self.group.backend} {name}", method, args)
        return CompletedWork() if async_op else None

    def all_reduce(self, tensor: Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Work | None:
        return self._call("all_reduce", (tensor, op), async_op)

    def all_reduce_coalesced(self, tensors: list[Tensor], op: ReduceOp = "sum",
                             async_op: bool = False) -> Work | None:
        """:func:`blutrain.dist.all_reduce_coalesced` over the wrapped group; inside a trace one event."""
        found = capture.active()
        if found is None:
            return all_reduce_coalesced(self.group, tensors, op, async_op)
        found.host_call(f"{self.group.backend} all_reduce_coalesced", self._all_reduce_coalesced, (list(tensors), op))
        return CompletedWork() if async_op else None

    def _all_reduce_coalesced(self, tensors: list[Tensor], op: ReduceOp) -> None:
        all_reduce_coalesced(self.group, tensors, op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = "sum",
                       async_op: bool = False) -> Work | None:
        return self._call("reduce_scatter", (output, input, op), async_op)

    def all_gather_into_tensor(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        return self._call("all_gather_into_tensor", (output, input), async_op)

    def all_gather(self, outputs: list[Tensor], input: Tensor, async_op: bool = False) -> Work | None:
        return self._call("all_gather", (outputs, input), async_op)

    def broadcast(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        return self._call("broadcast", (tensor, src), async_op)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False) -> Work | None:
        return self._call("all_to_all", (output, input), async_op)

    def send(self, tensor: Tensor, dst: int, async_op: bool = False) -> Work | None:
        return self._call("send", (tensor, dst), async_op)

    def recv(self, tensor: Tensor, src: int, async_op: bool = False) -> Work | None:
        return self._call("recv", (tensor, src), async_op)

    def sendrecv(self, send: Tensor, dst: int, recv: Tensor, src: int, async_op: bool = False) -> Work | None:
        """Send ``send`` to ``dst`` and receive into ``recv`` from ``src`` with both in flight together
        (:func:`blutrain.dist.sendrecv`). Inside a trace the pair is one event: posted and waited for as
        one, so a compiled call issues it between two parts without a rank blocking in a lone send."""
        found = capture.active()
        if found is None:
            return sendrecv(self.group, send, dst, recv, src, async_op)
        found.host_call(f"{self.group.backend} sendrecv", self._sendrecv, (send, dst, recv, src))
        return CompletedWork() if async_op else None

    def _sendrecv(self, send: Tensor, dst: int, recv: Tensor, src: int) -> None:
        sendrecv(self.group, send, dst, recv, src)

    def barrier(self) -> None:
        found = capture.active()
        if found is None:
            self.group.barrier()
        else:
            found.host_call(f"{self.group.backend} barrier", self.group.barrier, ())

    def split(self, color: int, key: int) -> TraceableGroup:
        check_not_captured("split")  # a new communicator cannot be part of a replay
        return TraceableGroup(self.group.split(color, key))

    def destroy(self) -> None:
        self.group.destroy()


def traceable(group: ProcessGroup) -> TraceableGroup:
    """``group`` declared for compilation: its collectives become cut points of a compiled step instead
    of being refused. Idempotent."""
    return group if isinstance(group, TraceableGroup) else TraceableGroup(group)


__all__ = ["TraceableGroup", "traceable"]
