"""A NumPy reference of Philox4x32-10 and of the draws ``philox.cu`` makes from it.

Counter-based: block i of a draw is the 128-bit counter ``offset + i`` (low 64 bits; the high 64 bits
are zero) encrypted under the 64-bit key ``seed``. The tests check the CUDA kernels against this,
and this against the known-answer vectors of Random123 (Salmon et al., SC'11).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)

U32 = np.ndarray[Any, np.dtype[np.uint32]]


def philox4x32_10_block(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """One block with a full 128-bit counter (for the known-answer vectors)."""
    c = [np.uint64(x) for x in ctr]
    k = [np.uint64(x) for x in key]
    for r in range(10):
        if r:
            k = [(k[0] + _W0) & _MASK, (k[1] + _W1) & _MASK]
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k[0]) & _MASK, p1 & _MASK,
             ((p0 >> np.uint64(32)) ^ c[3] ^ k[1]) & _MASK, p0 & _MASK]
    return (int(c[0]), int(c[1]), int(c[2]), int(c[3]))


def philox_words(seed: int, offset: int, ncounters: int) -> U32:
    """[ncounters, 4] uint32 words for counters offset .. offset + ncounters - 1 under key ``seed``."""
    ctr = (np.uint64(offset % 2**64) + np.arange(ncounters, dtype=np.uint64))
    c0, c1 = ctr & _MASK, ctr >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
            p0, p1 = _M0 * c0, _M1 * c2
            c0, c1, c2, c3 = (((p1 >> np.uint64(32)) ^ c1 ^ k0) & _MASK, p1 & _MASK,
                              ((p0 >> np.uint64(32)) ^ c3 ^ k1) & _MASK, p0 & _MASK)
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def uniform_f32(seed: int, offset: int, n: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """What ``philox_uniform_f32`` writes: (w >> 8) * 2^-24 for each word, in order."""
    w = philox_words(seed, offset, (n + 3) // 4).reshape(-1)[:n]
    return ((w >> np.uint32(8)).astype(np.float64) * 2.0**-24).astype(np.float32)


def integers(seed: int, offset: int, n: int, low: int, high: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """What ``philox_integers`` writes: low + floor(r64 * (high - low) / 2^64), r64 = (w0 << 32) | w1."""
    w = philox_words(seed, offset, (n + 1) // 2).astype(np.uint64).reshape(-1, 2)
    r = [int(a) << 32 | int(b) for a, b in w]
    span = high - low
    return np.asarray([low + (x * span >> 64) for x in r[:n]], dtype=np.int64)


def normal_f32(seed: int, offset: int, n: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Box-Muller as ``philox_normal_f32`` computes it, in float64 (the kernel rounds through float32)."""
    w = philox_words(seed, offset, (n + 3) // 4).astype(np.float64)
    out = np.empty((w.shape[0], 4))
    for h in range(2):
        u1 = (np.floor(w[:, 2 * h] / 256) + 1) * 2.0**-24
        u2 = np.floor(w[:, 2 * h + 1] / 256) * 2.0**-24
        r = np.sqrt(-2 * np.log(u1))
        out[:, 2 * h] = r * np.cos(2 * np.pi * u2)
        out[:, 2 * h + 1] = r * np.sin(2 * np.pi * u2)
    return out.reshape(-1)[:n]


# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key) -> output.
KNOWN_ANSWERS: tuple[tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int, int, int]], ...] = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)
