"""Token shards in the llm.c / modded-nanogpt format.

A shard is a 1024-byte header of 256 little-endian int32 — ``[0]`` the magic 20240520, ``[1]`` the
version 1, ``[2]`` the token count, the rest zero — followed by that many little-endian uint16
tokens. The same files train with llm.c's ``train_gpt2`` and modded-nanogpt, and theirs train here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from blutrain.data.errors import ShardError

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN_ID = 2**16 - 1  # tokens are stored as uint16
_MAX_TOKENS = 2**31 - 1  # the count lives in an int32

TokenMemmap = np.memmap[Any, np.dtype[np.uint16]]


def write_shard(path: str | os.PathLike[str], tokens: ArrayLike) -> Path:
    """Write ``tokens`` (a 1-D integer array, every id in [0, 65535]) as a shard at ``path``.

    The file is written under a temporary name and renamed into place, so a reader never sees a
    half-written shard. Returns the path written.
    """
    path = Path(path)
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ShardError(f"write_shard({path}): tokens must be 1-D, received shape {array.shape}")
    if array.size and not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
        raise ShardError(f"write_shard({path}): tokens must be integers, received dtype {array.dtype}")
    if array.size > _MAX_TOKENS:
        raise ShardError(
            f"write_shard({path}): a shard holds at most {_MAX_TOKENS} tokens (int32 count), "
            f"received {array.size}; split the tokens over several shards"
        )
    if array.size:
        bad = (array < 0) | (array > MAX_TOKEN_ID)
        if bad.any():
            where = int(np.argmax(bad))
            raise ShardError(
                f"write_shard({path}): token ids must be in [0, {MAX_TOKEN_ID}] to fit uint16, "
                f"received {int(array[where])} at position {where}"
            )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = SHARD_MAGIC
    header[1] = SHARD_VERSION
    header[2] = array.size
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(array.astype("<u2", copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# what a user who gave a text (or other) file as a shard should do
_NOT_A_SHARD = "; token shards are written from text files by `blutrain prepare TEXT... --out DIR`"


def read_shard(path: str | os.PathLike[str]) -> TokenMemmap:
    """Memory-map the tokens of the shard at ``path`` (read-only, nothing copied).

    Raises :class:`ShardError` naming the file when it cannot be opened (missing, a directory, no
    permission), is shorter than the header, has the wrong magic or version, or holds more or fewer
    bytes than its declared token count needs. Nothing else escapes: tools/fuzz_shards.py feeds
    this function mutated shards and treats any other exception as a bug.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise ShardError(f"shard {path}: no such file") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise ShardError(f"shard {path}: cannot be read: {e.strerror or e}") from None
    if size < HEADER_BYTES or len(head) < HEADER_BYTES:
        raise ShardError(f"shard {path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header"
                         + _NOT_A_SHARD)
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4", count=3))
    if magic != SHARD_MAGIC:
        raise ShardError(
            f"shard {path}: wrong magic number, expected {SHARD_MAGIC}, received {magic} "
            f"(not an llm.c / modded-nanogpt token shard){_NOT_A_SHARD}"
        )
    if version != SHARD_VERSION:
        raise ShardError(f"shard {path}: unsupported version, expected {SHARD_VERSION}, received {version}")
    if count < 0:
        raise ShardError(f"shard {path}: header declares a negative token count ({count})")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        what = "truncated" if size < expected else "oversized"
        raise ShardError(
            f"shard {path}: {what}: header declares {count} tokens, so the file should be {expected} "
            f"bytes; received {size} bytes"
        )
    try:
        return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    except (OSError, ValueError) as e:  # the file changed under us between the checks and the mapping
        raise ShardError(f"shard {path}: cannot be mapped: {e}") from None
