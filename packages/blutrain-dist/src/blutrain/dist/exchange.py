"""A paired peer-to-peer exchange: send one tensor and receive another, both posted before either is waited
for.

A ring (context parallelism's ring attention) sends to one neighbour while it receives from the other.
Issued one at a time, each rank would block in its send or recv while its peer blocks in its own; posted
together, every rank's pair completes. :func:`sendrecv` is that pair as one operation, so that a group
declared with :func:`blutrain.dist.traceable` can hand it to a compiler trace whole: one collective op of a
compiled step that posts both and waits for both, where two separate ops, each completing before the next is
issued, would deadlock.
"""

from __future__ import annotations

from blutrain.tensor import Tensor

from blutrain.dist.process_group import ProcessGroup, Work


class WorkList:
    """Several operations in flight as one handle: ``wait()`` waits for each."""

    def __init__(self, works: list[Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def post_sendrecv(group: ProcessGroup, send: Tensor, dst: int, recv: Tensor, src: int) -> WorkList:
    """``recv`` from rank ``src`` and ``send`` to rank ``dst`` of ``group``, both posted (``async_op=True``);
    the handle waits for both."""
    works = [group.recv(recv, src, async_op=True), group.send(send, dst, async_op=True)]
    return WorkList([w for w in works if w is not None])


def sendrecv(group: ProcessGroup, send: Tensor, dst: int, recv: Tensor, src: int,
             async_op: bool = False) -> Work | None:
    """Send ``send`` to rank ``dst`` and receive into ``recv`` from rank ``src``, both in flight together.
    A group with a ``sendrecv`` method of its own (:class:`~blutrain.dist.TraceableGroup`: one event of a
    compiled step) does it; otherwise the pair is posted on ``group`` (inside a compiler trace a plain
    group's send and recv are refused, as any of its collectives). ``async_op``: return the handle instead
    of waiting."""
    own = getattr(group, "sendrecv", None)
    if own is not None:
        result: Work | None = own(send, dst, recv, src, async_op=async_op)
        return result
    work = post_sendrecv(group, send, dst, recv, src)
    if async_op:
        return work
    work.wait()
    return None


__all__ = ["WorkList", "post_sendrecv", "sendrecv"]
