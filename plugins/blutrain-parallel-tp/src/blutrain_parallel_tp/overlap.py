"""Async tensor parallelism: a layer's collective overlapped with its GEMMs, chunk by chunk.

Without sequence parallelism a Megatron layer has one collective on its critical path: the
row-parallel Linear all-reduces its output forward, the column-parallel Linear all-reduces its input
gradient backward. Each op here fuses that collective into the GEMM that feeds it and cuts the GEMM
along its rows (the tokens, ``B·T``) into ``chunks`` blocks. Block ``i``'s all-reduce is started with
``async_op=True`` as soon as its GEMM is issued, so it runs on the group's communication stream (NCCL)
or as a non-blocking MPI request while the GEMM of block ``i + 1`` runs; every handle is waited for
once, before the blocks are joined:

- ``row_parallel_linear(x_r, W_r)``: ``Σ_ranks x_r W_rᵀ``, forward ``y_i = x_i W_rᵀ`` then
  ``all_reduce(y_i)`` while ``y_{i+1}`` is computed. Backward is a plain linear's (no collective).
- ``column_parallel_linear(x, W_r, b_r)``: ``x W_rᵀ + b_r``, forward a plain linear (no collective).
  Backward ``dx_i = dy_i W_r`` then ``all_reduce(dx_i)`` while ``dx_{i+1}`` and, after the last block,
  the weight and bias gradients (``dW_r = dyᵀ x``, which needs no reduction) are computed.

Rows are independent in both GEMMs and the all-reduce sums each element over the same ranks, so the
result is the synchronous layers' (``copy_to_tp_region`` / ``reduce_from_tp_region`` around
``linear``) up to the GEMM's blocking. Each op is one autograd node that keeps the inputs a linear
keeps; under autocast its inputs are lowered first (recorded casts, as ``linear`` does), so the
collectives move the low-precision blocks.
"""

from __future__ import annotations

from typing import Any

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import no_double_backward, save_inputs
from blutrain.dist import DistArgumentError, ProcessGroup, Work
from blutrain.tensor import Tensor, cat, dispatch, linear, matmul
from blutrain.tensor.autocast import lower
from blutrain_parallel_tp.comm import grad_or_zeros

COLUMN_PARALLEL_LINEAR = "tp_column_parallel_linear"
ROW_PARALLEL_LINEAR = "tp_row_parallel_linear"


def check_chunks(where: str, chunks: object) -> int:
    """``chunks`` as the number of row blocks of an async layer (an int >= 1)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise DistArgumentError(f"{where}: async_chunks must be an int >= 1 (the row blocks whose all-reduce "
                                f"overlaps the next block's GEMM), got {chunks!r}")
    return chunks


def row_blocks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``min(chunks, rows)`` blocks of near-equal size covering ``rows`` rows."""
    n = max(min(chunks, rows), 1)
    size, extra = divmod(rows, n)
    out, at = [], 0
    for i in range(n):
        length = size + (i < extra)
        out.append((at, length))
        at += length
    return out


def _reduced_blocks(rows: Tensor, weight: Tensor, group: ProcessGroup, chunks: int, transpose: bool) -> Tensor:
    """``rows @ weightᵀ`` (``transpose``) or ``rows @ weight`` summed over ``group``, block by block: each
    block's all-reduce is in flight while the next block's GEMM runs."""
    blocks: list[Tensor] = []
    works: list[Work | None] = []
    for start, length in row_blocks(rows.shape[0], chunks):
        part = rows.narrow(0, start, length)
        block = linear(part, weight) if transpose else matmul(part, weight)
        works.append(group.all_reduce(block, op="sum", async_op=True))
        blocks.append(block)
    for work in works:
        if work is not None:
            work.wait()
    return blocks[0] if len(blocks) == 1 else cat(blocks, dim=0)


def row_parallel_linear(x: Tensor, weight: Tensor, group: ProcessGroup, chunks: int) -> Tensor:
    """``x @ weightᵀ`` summed over ``group`` (``x``: this rank's input columns, ``weight``: its columns of
    the full weight), each of ``chunks`` row blocks all-reduced while the next one's GEMM runs. The
    bias is the caller's: it is added once, after the sum."""
    x, weight = lower(x), lower(weight)
    if x.ndim < 1 or weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise DistArgumentError(f"row_parallel_linear: input of shape {list(x.shape)} does not fit weight of shape "
                                f"{list(weight.shape)} (expected input[..., {weight.shape[1]}])")
    lead = tuple(x.shape[:-1])
    with no_grad():
        rows = x.detach().reshape(-1, x.shape[-1])
        out = _reduced_blocks(rows, weight.detach(), group, chunks, transpose=True).reshape(*lead, weight.shape[0])
    record(ROW_PARALLEL_LINEAR, (x, weight), out, {})
    return out


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group: ProcessGroup,
                           chunks: int) -> Tensor:
    """``x @ weightᵀ + bias`` (``weight``, ``bias``: this rank's output rows); backward the input
    gradient is summed over ``group`` in ``chunks`` row blocks, each all-reduced while the next block's
    GEMM and then the weight gradient's run."""
    x, weight, bias = lower(x), lower(weight), lower(bias)
    with no_grad():
        out = linear(x.detach(), weight.detach(), None if bias is None else bias.detach())
    record(COLUMN_PARALLEL_LINEAR, (x, weight, bias), out, {"group": group, "chunks": chunks})
    return out


@derivative(ROW_PARALLEL_LINEAR, save=save_inputs)
def _row_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor | None, ...]:
    no_double_backward(ROW_PARALLEL_LINEAR, create_graph)
    x, weight = node.saved
    g = grad_or_zeros(node, grads)
    gx, gw, _ = _linear_backward(g, x, weight, node.needs[0], node.needs[1], False)
    return gx, gw


@derivative(COLUMN_PARALLEL_LINEAR, save=save_inputs)
def _column_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor | None, ...]:
    no_double_backward(COLUMN_PARALLEL_LINEAR, create_graph)
    x, weight, bias = node.saved
    group: ProcessGroup = node.attrs["group"]
    # every rank reduces the input gradient, needed or not, so that the collectives stay matched
    g = grad_or_zeros(node, grads)
    g_rows = g.reshape(-1, g.shape[-1])
    blocks: list[Tensor] = []
    works: list[Work | None] = []
    for start, length in row_blocks(g_rows.shape[0], node.attrs["chunks"]):
        block = matmul(g_rows.narrow(0, start, length), weight.detach())
        works.append(group.all_reduce(block, op="sum", async_op=True))
        blocks.append(block)
    # the weight and bias gradients need no reduction: they run while the last blocks are reduced
    _, gw, gb = _linear_backward(g, x, weight, False, node.needs[1], bias is not None and node.needs[2])
    for work in works:
        if work is not None:
            work.wait()
    gx = (blocks[0] if len(blocks) == 1 else cat(blocks, dim=0)).reshape(x.shape)
    return gx if node.needs[0] else None, gw, gb


def _linear_backward(g: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool,
                     need_b: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``linear``'s own backward kernel: (dx, dW, db) of ``y = x Wᵀ + b``."""
    gx, gw, gb = dispatch.kernel("linear_backward", x.device.type, x.dtype)(
        g.detach()._data, x.detach()._data, weight.detach()._data, need_x, need_w, need_b)
    return tuple(None if d is None else Tensor._make(d, x.dtype, x.device)  # type: ignore[return-value]
                 for d in (gx, gw, gb))


__all__ = ["COLUMN_PARALLEL_LINEAR", "ROW_PARALLEL_LINEAR", "check_chunks", "column_parallel_linear",
           "row_blocks", "row_parallel_linear"]
