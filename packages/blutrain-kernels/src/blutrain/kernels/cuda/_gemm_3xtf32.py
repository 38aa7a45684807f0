"""Launcher of ``gemm_3xtf32.cu``: float32 GEMM at float32 accuracy on the tensor cores (3xTF32), with
deterministic split-K; not an op of the registry: the cuda backend routes GEMMs to it."""

from __future__ import annotations

import numpy as np

from blutrain.kernels.cuda._core import (
    Array,
    _aligned,
    _cp,
    _launch,
    sm_count,
)
from blutrain.tensor.errors import ShapeError

# gemm_3xtf32.cu's tiling: 128 x 128 output tiles, 32-deep k-tiles, 256 threads, a 4-stage ring of A and B
# k-tiles in dynamic shared memory.
_GEMM_TILE = 128
_GEMM_BK = 32
_GEMM_THREADS = 256
_GEMM_SMEM = 4 * 2 * _GEMM_TILE * _GEMM_BK * 4
_GEMM_MAX_SPLITS = 16
_GEMM_SPLIT_BYTES = 256 * 2**20  # at most this much float32 workspace for split-K partials
# Products below this many FLOPs are declined: a few microseconds of work, where launch and tile
# overheads set the pace and cuBLAS's strict SGEMM is as fast.
GEMM_3XTF32_MIN_FLOPS = 2 * 256**3


def _gemm_splits(tiles: int, kt: int, mn: int, sms: int) -> int:
    """K splits of gemm_3xtf32 for ``tiles`` output tiles, ``kt`` k-tiles and an M x N of ``mn`` on ``sms``
    multiprocessors: 1 when the tiles alone fill the GPU for several waves, else the count whose blocks fill
    the last wave best (1 block per SM), less 1 % per split for the partials' traffic; each split keeps at
    least 8 k-tiles, and the partials fit in 256 MiB."""
    if tiles >= 4 * sms or kt < 16:
        return 1
    most = min(_GEMM_MAX_SPLITS, kt // 8, max(1, _GEMM_SPLIT_BYTES // (4 * mn)))
    best, best_score = 1, -1.0
    for s in range(1, most + 1):
        blocks = tiles * s
        score = blocks / (-(-blocks // sms) * sms) - 0.01 * s
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


_gemm_devices: dict[int, bool] = {}


def _gemm_fits_device() -> bool:
    """Whether the current device runs gemm_3xtf32.cu: TF32 mma.sync and cp.async (compute capability 8.0 or
    later) and 128 KB of shared memory per block (A100, H100; not the 99 KB of sm_86/sm_89 parts)."""
    cp = _cp()
    dev = cp.cuda.Device()
    ok = _gemm_devices.get(dev.id)
    if ok is None:
        ok = (int(dev.compute_capability) >= 80
              and int(dev.attributes["MaxSharedMemoryPerBlockOptin"]) >= _GEMM_SMEM)
        _gemm_devices[dev.id] = ok
    return ok


def gemm_3xtf32(a: Array, b: Array, out: Array, trans_a: bool = False, trans_b: bool = False,
                accumulate: bool = False, *, min_flops: int = GEMM_3XTF32_MIN_FLOPS) -> bool:
    """``out = op(a) @ op(b)`` (``out +=`` with ``accumulate``) in float32 at float32 accuracy on the tensor
    cores (3xTF32, gemm_3xtf32.cu), the argument convention of the cuda backend's ``gemm_into``: ``a`` is
    [M, K], or [K, M] with ``trans_a``; ``b`` is [K, N], or [N, K] with ``trans_b``; ``out`` is [M, N]. A
    linear layer's forward x Wᵀ is ``trans_b``, its input gradient dy W plain, its weight gradient dyᵀ x
    ``trans_a``. Deterministic (split-K partials are added in a fixed order).

    Returns False, and leaves ``out`` alone, when it declines: an operand or ``out`` that is not a
    C-contiguous 2-D float32 array, a size of 2**31 or more, fewer than ``min_flops`` FLOPs (2 M N K) to
    do, or a device without TF32 tensor cores and 128 KB of shared memory per block. Operand shapes that
    do not fit ``out`` raise ShapeError.
    """
    if a.dtype != np.float32 or b.dtype != np.float32 or out.dtype != np.float32:
        return False
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return False
    if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
        return False
    M, K = (int(a.shape[1]), int(a.shape[0])) if trans_a else (int(a.shape[0]), int(a.shape[1]))
    kb, N = (int(b.shape[1]), int(b.shape[0])) if trans_b else (int(b.shape[0]), int(b.shape[1]))
    if kb != K or tuple(out.shape) != (M, N):
        raise ShapeError(f"gemm_3xtf32: op(a) is {M}x{K} (a {tuple(a.shape)}, trans_a={trans_a}) and op(b) {kb}x{N} "
                         f"(b {tuple(b.shape)}, trans_b={trans_b}); out must be ({M}, {N}), got {tuple(out.shape)}")
    flops = 2 * M * N * K
    if max(M, N, K) >= 2**31 or flops < min_flops or not _gemm_fits_device():
        return False
    if M == 0 or N == 0:
        return True
    if K == 0:
        if not accumulate:
            out.fill(0)
        return True
    # 16-byte copies when every operand's contiguous extent is a multiple of 4 floats and its base aligned
    vec = ((K if not trans_a else M) % 4 == 0 and (K if trans_b else N) % 4 == 0 and _aligned(a, b))
    name = f"gemm3x_{'t' if trans_a else 'n'}{'t' if trans_b else 'n'}_v{4 if vec else 1}"
    tiles = -(-M // _GEMM_TILE) * -(-N // _GEMM_TILE)
    kt = -(-K // _GEMM_BK)
    splits = _gemm_splits(tiles, kt, M * N, sm_count())
    per_split = -(-kt // splits)
    splits = -(-kt // per_split)  # no empty split
    dims = (np.int32(M), np.int32(N), np.int32(K))
    if splits == 1:
        cvec = N % 4 == 0 and _aligned(out)
        _launch("gemm_3xtf32", name, (tiles, 1, 1), (_GEMM_THREADS,),
                (a, b, out, *dims, np.int32(bool(accumulate)), np.int32(cvec), np.int32(per_split)), _GEMM_SMEM)
        return True
    ws = _cp().empty((splits, M, N), np.float32)
    _launch("gemm_3xtf32", name, (tiles, 1, splits), (_GEMM_THREADS,),
            (a, b, ws, *dims, np.int32(0), np.int32(N % 4 == 0), np.int32(per_split)), _GEMM_SMEM)
    mn = M * N
    rvec = 4 if mn % 4 == 0 and _aligned(out) else 1
    blocks = max(1, min(-(-mn // (rvec * _GEMM_THREADS)), 8 * sm_count()))
    _launch("gemm_3xtf32", f"gemm3x_splitk_reduce_v{rvec}", (blocks,), (_GEMM_THREADS,),
            (ws, out, np.int64(mn), np.int32(splits), np.int32(bool(accumulate))))
    return True
