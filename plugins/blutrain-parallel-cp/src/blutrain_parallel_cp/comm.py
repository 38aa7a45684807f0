"""Differentiable collectives of context parallelism, one autograd op each (recorded through
``blutrain.autograd.record`` with a rule registered by ``blutrain.autograd.derivative``).

- ``ring_shift(x)``: send ``x`` to the next rank, receive the previous rank's; backward sends the
  gradient the other way round (to the rank it came from). :func:`start_ring_shift` starts the
  transfer and returns a handle, so the caller computes while the bytes move (ring attention).
- ``all_gather(x)``: every rank's ``x`` stacked along a new leading dim; backward reduce-scatters
  (sums) the gradient, so each rank gets the sum of what every rank's use of its block produced.
- ``all_to_all(x)``: block s of dim 0 goes to rank s; backward is the same exchange of the gradient
  (block s of the output came from rank s, so its gradient goes back there).

The rules keep nothing for backward but the group. A rank whose output got no gradient still joins
the backward collective with zeros.

Every buffer a collective writes is made by a kernel (``zeros``, not ``empty``), and a ring transfer is
one :func:`blutrain.dist.sendrecv` (send and recv posted together), so that over a group declared with
:func:`blutrain.dist.traceable` each is one event a compiled step can issue between its parts.
"""

from __future__ import annotations

from typing import Any

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import save_nothing
from blutrain.dist import ProcessGroup, Work, sendrecv
from blutrain.tensor import Tensor, zeros, zeros_like

RING_SHIFT = "cp_ring_shift"
ALL_GATHER = "cp_all_gather"
ALL_TO_ALL = "cp_all_to_all"


def incoming_grad(node: Any, grads: list[Any]) -> Tensor:
    """The gradient a backward rule receives for the op's one output, contiguous; zeros where none flowed."""
    g = grads[0]
    if g is None:
        shape, dtype, device = node.out_meta[0]
        return zeros(*shape, dtype=dtype, device=device)
    return g.contiguous()  # type: ignore[no-any-return]


def start_exchange(x: Tensor, group: ProcessGroup, to: int, frm: int) -> tuple[Tensor, Work | None]:
    """Start sending ``x`` to ``to`` and receiving as much from ``frm``; both in flight together, so no
    rank blocks in a send while its peer blocks in one too."""
    out = zeros_like(x)
    return out, sendrecv(group, x, to, out, frm, async_op=True)


class RingShift:
    """A ring transfer in flight; :meth:`finish` waits and returns the received tensor, recorded
    so that backward sends its gradient back."""

    def __init__(self, x: Tensor, group: ProcessGroup) -> None:
        self.x = x
        self.group = group
        r, n = group.rank, group.size
        with no_grad():
            self.payload = x.detach().contiguous()
            self.out, self.work = start_exchange(self.payload, group, (r + 1) % n, (r - 1) % n)

    def finish(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        out = self.out
        record(RING_SHIFT, (self.x,), out, {"group": self.group})
        return out


def start_ring_shift(x: Tensor, group: ProcessGroup) -> RingShift:
    """Send ``x`` to rank ``r + 1`` and receive rank ``r - 1``'s (mod size); returns the transfer."""
    return RingShift(x, group)


def ring_shift(x: Tensor, group: ProcessGroup) -> Tensor:
    return start_ring_shift(x, group).finish()


@derivative(RING_SHIFT, save=save_nothing)
def _ring_shift_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    group: ProcessGroup = node.attrs["group"]
    r, n = group.rank, group.size
    out, work = start_exchange(incoming_grad(node, grads), group, (r - 1) % n, (r + 1) % n)
    if work is not None:
        work.wait()
    return (out,)


def gather_unrecorded(x: Tensor, group: ProcessGroup) -> Tensor:
    """(size, *x.shape): rank s's ``x`` at index s (not recorded)."""
    with no_grad():
        out = zeros(group.size, *x.shape, dtype=x.dtype, device=x.device)
        group.all_gather_into_tensor(out, x.detach().contiguous().unsqueeze(0))
    return out


def reduce_scatter_unrecorded(x: Tensor, group: ProcessGroup) -> Tensor:
    """The sum over ranks of ``x`` (size, ...) at index ``rank``: x.shape[1:] (not recorded)."""
    with no_grad():
        out = zeros(1, *x.shape[1:], dtype=x.dtype, device=x.device)
        group.reduce_scatter(out, x.contiguous(), op="sum")
    return out.squeeze(0)


def all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    """(size, *x.shape): rank s's ``x`` at index s."""
    out = gather_unrecorded(x, group)
    record(ALL_GATHER, (x,), out, {"group": group})
    return out


@derivative(ALL_GATHER, save=save_nothing)
def _all_gather_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    return (reduce_scatter_unrecorded(incoming_grad(node, grads), node.attrs["group"]),)


def all_to_all(x: Tensor, group: ProcessGroup) -> Tensor:
    """Block s of dim 0 (``size`` equal blocks) to rank s; block s of the result from rank s."""
    with no_grad():
        src = x.detach().contiguous()
        out = zeros_like(src)
        group.all_to_all(out, src)
    record(ALL_TO_ALL, (x,), out, {"group": group})
    return out


@derivative(ALL_TO_ALL, save=save_nothing)
def _all_to_all_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor]:
    g = incoming_grad(node, grads)
    out = zeros_like(g)
    node.attrs["group"].all_to_all(out, g)
    return (out,)


# the transfers without autograd and the backward rules' gradient are shared with attention.py
__all__ = ["ALL_GATHER", "ALL_TO_ALL", "RING_SHIFT", "RingShift", "all_gather", "all_to_all", "gather_unrecorded",
           "incoming_grad", "reduce_scatter_unrecorded", "ring_shift", "start_exchange", "start_ring_shift"]
