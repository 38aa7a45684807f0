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
``linear``) up to the GEMM's blocking. Each op is one autograd node that keeps what a linear keeps.
Under autocast it treats its operands as ``linear`` does: they are rounded to the region's dtype inside
the op (no recorded cast), the product is in that dtype (the forward all-reduce moves low-precision
blocks, as the synchronous row-parallel layer's does), and the gradients of float32 operands come out
of the backward GEMMs' float32 accumulators in float32, so the column-parallel input gradient is
all-reduced in float32 like the synchronous layer's, and no cast kernel runs per gradient.
"""

from __future__ import annotations

from typing import Any

from blutrain.autograd import derivative, no_grad, record
from blutrain.autograd.rules import no_double_backward, save_nothing
from blutrain.dist import DistArgumentError, ProcessGroup, Work
from blutrain.tensor import DType, Tensor, cat, dispatch, float32, get_autocast_dtype, linear
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


def _narrowed(t: Tensor | None) -> Tensor | None:
    """``t`` in the autocast region's dtype when it is a floating tensor of another dtype, converted but not
    recorded: the op records itself against ``t`` and keeps this copy for its backward (as ``linear``)."""
    dt = get_autocast_dtype()
    if dt is None or t is None or not t.dtype.is_floating or t.dtype is dt:
        return t
    with no_grad():
        return t.to(dtype=dt)


def _wide(original: DType, narrowed: Tensor) -> bool:
    """Whether the gradient of an operand of dtype ``original`` comes out of the GEMM in float32: a float32
    operand that autocast narrowed (``linear_autocast``'s rule)."""
    return original is float32 and narrowed.dtype is not float32


def _as_dtype(grad: Tensor | None, dtype: DType) -> Tensor | None:
    return grad if grad is None or grad.dtype is dtype else grad.to(dtype=dtype)


def _reduced_blocks(rows: Tensor, weight: Tensor, group: ProcessGroup, chunks: int) -> Tensor:
    """``rows @ weightᵀ`` summed over ``group``, block by block: each block's all-reduce is in flight while
    the next block's GEMM runs."""
    blocks: list[Tensor] = []
    works: list[Work | None] = []
    for start, length in row_blocks(rows.shape[0], chunks):
        block = linear(rows.narrow(0, start, length), weight)
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
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or x.ndim < 1 or weight.ndim != 2 or \
            x.shape[-1] != weight.shape[1]:
        got = [list(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (x, weight)]
        raise DistArgumentError(f"row_parallel_linear: input of shape {got[0]} does not fit weight of shape "
                                f"{got[1]} (expected a weight (out, in) and an input [..., in])")
    xl, wl = _narrowed(x), _narrowed(weight)
    assert xl is not None and wl is not None  # narrowed Tensors
    lead = tuple(x.shape[:-1])
    with no_grad():
        rows = xl.detach().reshape(-1, x.shape[-1])
        out = _reduced_blocks(rows, wl.detach(), group, chunks).reshape(*lead, weight.shape[0])
    record(ROW_PARALLEL_LINEAR, (x, weight), out, {"x": xl.detach(), "weight": wl.detach(),
                                                    "dtypes": (x.dtype, weight.dtype)})
    return out


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group: ProcessGroup,
                           chunks: int) -> Tensor:
    """``x @ weightᵀ + bias`` (``weight``, ``bias``: this rank's output rows); backward the input
    gradient is summed over ``group`` in ``chunks`` row blocks, each all-reduced while the next block's
    GEMM and then the weight gradient's run."""
    xl, wl, bl = _narrowed(x), _narrowed(weight), _narrowed(bias)
    assert xl is not None and wl is not None  # narrowed Tensors
    with no_grad():
        out = linear(xl.detach(), wl.detach(), None if bl is None else bl.detach())
    record(COLUMN_PARALLEL_LINEAR, (x, weight, bias), out, {
        "group": group, "chunks": chunks, "x": xl.detach(), "weight": wl.detach(),
        "dtypes": (x.dtype, weight.dtype, None if bias is None else bias.dtype)})
    return out


@derivative(ROW_PARALLEL_LINEAR, save=save_nothing)
def _row_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor | None, ...]:
    no_double_backward(ROW_PARALLEL_LINEAR, create_graph)
    x, weight = node.attrs["x"], node.attrs["weight"]
    dtx, dtw = node.attrs["dtypes"]
    g = grad_or_zeros(node, grads)
    gx, gw, _ = _linear_backward(g, x, weight, node.needs[0], node.needs[1], False, _wide(dtx, x), _wide(dtw, weight))
    return _as_dtype(gx, dtx), _as_dtype(gw, dtw)


@derivative(COLUMN_PARALLEL_LINEAR, save=save_nothing)
def _column_backward(node: Any, grads: list[Any], create_graph: bool) -> tuple[Tensor | None, ...]:
    no_double_backward(COLUMN_PARALLEL_LINEAR, create_graph)
    a = node.attrs
    x, weight = a["x"], a["weight"]
    dtx, dtw, dtb = a["dtypes"]
    wide_x, wide_w = _wide(dtx, x), _wide(dtw, weight)
    group: ProcessGroup = a["group"]
    # every rank reduces the input gradient, needed or not, so that the collectives stay matched
    g = grad_or_zeros(node, grads)
    g_rows = g.reshape(-1, g.shape[-1])
    x_rows = x.reshape(-1, x.shape[-1])
    blocks: list[Tensor] = []
    works: list[Work | None] = []
    for start, length in row_blocks(g_rows.shape[0], a["chunks"]):
        block, _, _ = _linear_backward(g_rows.narrow(0, start, length), x_rows.narrow(0, start, length), weight,
                                       True, False, False, wide_x, False)
        assert block is not None  # asked for
        works.append(group.all_reduce(block, op="sum", async_op=True))
        blocks.append(block)
    # the weight and bias gradients need no reduction: they run while the last blocks are reduced
    _, gw, gb = _linear_backward(g, x, weight, False, node.needs[1], dtb is not None and node.needs[2], False, wide_w)
    for work in works:
        if work is not None:
            work.wait()
    gx = (blocks[0] if len(blocks) == 1 else cat(blocks, dim=0)).reshape(x.shape)
    return (_as_dtype(gx, dtx) if node.needs[0] else None), _as_dtype(gw, dtw), \
        None if dtb is None else _as_dtype(gb, dtb)


def _linear_backward(g: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool, need_b: bool,
                     wide_x: bool, wide_w: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``linear``'s own backward kernel: (dx, dW, db) of ``y = x Wᵀ + b``, in x's dtype, or float32 for dx
    with ``wide_x`` and for dW, db with ``wide_w`` (from the GEMMs' float32 accumulators)."""
    wide = (float32 if wide_x else x.dtype, float32 if wide_w else x.dtype)
    gx, gw, gb = dispatch.call_multi("linear_backward", g, x, weight, need_x, need_w, need_b, wide_x, wide_w,
                                     dtype=x.dtype, out_dtypes=(wide[0], wide[1], wide[1]))
    return gx, gw, gb


__all__ = ["COLUMN_PARALLEL_LINEAR", "ROW_PARALLEL_LINEAR", "check_chunks", "column_parallel_linear",
           "row_blocks", "row_parallel_linear"]
