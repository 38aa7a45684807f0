"""TokenLoader: deterministic, resumable (x, y) batches from token shards, llm.c style.

Each step reads ``B*T + 1`` contiguous tokens per rank; ``x`` is the first ``B*T`` and ``y`` the
same shifted by one. In a shard, the ranks of one step read adjacent slices — rank ``r`` at
``position + r*B*T`` — and ``position`` then advances by ``B*T*world_size``, so the ranks of a
step see disjoint tokens and together exactly what one process with ``world_size * B`` rows would.
A shard is left when the next step would not fit; the shards of each epoch come in a seeded
permutation. The whole state is (epoch, shard index, position): ``state_dict`` saves it and
``load_state_dict`` continues with the very batch an uninterrupted loader would have produced.

Batches are NumPy int64 arrays; turning them into tensors is the trainer's job
(``blutrain.tensor.from_numpy``), so this module depends only on NumPy.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from blutrain.data.errors import LoaderError
from blutrain.data.shard import MAX_TOKEN_ID, TokenMemmap, read_shard

Batch = tuple[NDArray[np.int64], NDArray[np.int64]]

STATE_FORMAT = "blutrain.data.TokenLoader/1"
# Keys of a saved state that must equal the loader's own for the state to mean the same batches.
_FIXED_KEYS = ("seed", "batch_size", "seq_len", "world_size", "num_shards", "shards_digest")


def find_shards(pattern_or_dir: str | os.PathLike[str]) -> list[Path]:
    """The shard files named by a directory (its ``*.bin``) or a glob pattern, sorted.

    A directory holding both ``train_*.bin`` and ``val_*.bin`` (what `prepare` writes) is refused:
    mixing the splits would train on the validation set.
    """
    where = Path(pattern_or_dir)
    if where.is_dir():
        shards = sorted(p for p in where.glob("*.bin") if p.is_file())
        if not shards:
            raise LoaderError(f"shard directory {where} holds no *.bin files")
        names = {p.name.split("_", 1)[0] for p in shards}
        if {"train", "val"} <= names:
            raise LoaderError(
                f"shard directory {where} holds both train_*.bin and val_*.bin shards; pass a pattern "
                f"naming one split, e.g. {where / 'train_*.bin'}"
            )
        return shards
    shards = sorted(Path(p) for p in glob.glob(os.fspath(pattern_or_dir)) if Path(p).is_file())
    if not shards:
        raise LoaderError(
            f"no shard files match {os.fspath(pattern_or_dir)!r} (expected a directory or a glob)"
        )
    return shards


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise LoaderError(f"TokenLoader: {name} must be a positive integer, received {value!r}")
    return int(value)


class TokenLoader:
    """Batches of shape (batch_size, seq_len) from the shards of ``pattern_or_dir``.

    Every shard's header and size are checked when the loader is built (a stat and 1 KiB each): a
    valid header, a file size that matches it, and at least ``batch_size*seq_len*world_size + 1``
    tokens. When ``vocab_size`` is given, a shard's token ids are checked against it (one max over
    the shard) the first time the loader enters it: the first shard at construction, the others
    when their turn comes, so a large dataset is not read twice before the first step. Errors are
    :class:`ShardError` (the file itself is malformed) or :class:`LoaderError` (it does not fit
    these settings), each naming the file. Iteration never ends; epochs follow each other.
    """

    _epoch_order: NDArray[np.int64]
    _tokens: TokenMemmap

    def __init__(
        self,
        pattern_or_dir: str | os.PathLike[str],
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        self.batch_size = _positive_int("batch_size", batch_size)
        self.seq_len = _positive_int("seq_len", seq_len)
        self.world_size = _positive_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < world_size:
            raise LoaderError(f"TokenLoader: rank must be in [0, {world_size - 1}], received {rank!r}")
        self.rank = int(rank)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise LoaderError(f"TokenLoader: seed must be a non-negative integer, received {seed!r}")
        self.seed = int(seed)
        if vocab_size is not None and not 1 <= _positive_int("vocab_size", vocab_size) <= MAX_TOKEN_ID + 1:
            raise LoaderError(
                f"TokenLoader: vocab_size must be in [1, {MAX_TOKEN_ID + 1}] (uint16 shards), "
                f"received {vocab_size}"
            )
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.shards = find_shards(pattern_or_dir)
        self.shard_lengths = [self._check_length(p) for p in self.shards]
        self._range_checked: set[int] = set()  # shards whose token ids were checked against vocab_size
        digest = hashlib.sha1()
        for path, length in zip(self.shards, self.shard_lengths, strict=True):
            digest.update(f"{path.name}:{length}\n".encode())
        self.shards_digest = digest.hexdigest()[:16]
        self.epoch = self.shard_index = self.position = self._shard = -1
        self.reset()

    @property
    def tokens_per_step(self) -> int:
        """Tokens all ranks together consume per step (the stride of ``position``)."""
        return self.batch_size * self.seq_len * self.world_size

    def _check_length(self, path: Path) -> int:
        tokens = read_shard(path)
        need = self.tokens_per_step + 1
        if len(tokens) < need:
            raise LoaderError(
                f"shard {path}: holds {len(tokens)} tokens, fewer than one step needs: batch_size*seq_len*"
                f"world_size+1 = {self.batch_size}*{self.seq_len}*{self.world_size}+1 = {need}; use a smaller "
                "--batch-size or --seq-len, or more text"
            )
        return len(tokens)

    @staticmethod
    def _check_token_range(path: Path, tokens: TokenMemmap, vocab_size: int) -> None:
        top = int(tokens.max())
        if top >= vocab_size:
            where = int(np.argmax(tokens >= vocab_size))
            raise LoaderError(
                f"shard {path}: token id {int(tokens[where])} at position {where} is outside the "
                f"vocabulary, expected ids < vocab_size={vocab_size} "
                f"(largest id in the shard: {top})"
            )

    def _order(self, epoch: int) -> NDArray[np.int64]:
        # One Philox stream per epoch (jumped by 2**128 draws each), so an epoch's order depends only
        # on (seed, epoch) and resuming needs no generator state.
        rng = np.random.Generator(np.random.Philox(self.seed).jumped(epoch))
        return rng.permutation(len(self.shards))

    def _enter(self, epoch: int, shard_index: int, position: int) -> None:
        order = self._epoch_order if epoch == self.epoch else self._order(epoch)
        shard = int(order[shard_index])
        if shard != self._shard:
            tokens = read_shard(self.shards[shard])  # only the current shard stays mapped
            if len(tokens) != self.shard_lengths[shard]:
                raise LoaderError(
                    f"shard {self.shards[shard]}: holds {len(tokens)} tokens now, {self.shard_lengths[shard]} "
                    "when the loader was built; a shard must not change during training"
                )
            if self.vocab_size is not None and shard not in self._range_checked:
                self._check_token_range(self.shards[shard], tokens, self.vocab_size)
                self._range_checked.add(shard)
            self._shard, self._tokens = shard, tokens
        # Only now, with the shard known good, does the position move: a failed check leaves the
        # loader where it was.
        self._epoch_order = order
        self.epoch, self.shard_index, self.position = epoch, shard_index, position

    def reset(self) -> None:
        """Go back to the first batch of epoch 0."""
        self._enter(0, 0, 0)

    @property
    def current_shard(self) -> Path:
        """The shard the next batch comes from."""
        return self.shards[self._shard]

    def next_batch(self) -> Batch:
        """This rank's next (x, y): int64 arrays of shape (batch_size, seq_len), y = x shifted by one.

        Both are views of one fresh (B*T+1)-token buffer, so writing into one changes the other."""
        B, T = self.batch_size, self.seq_len
        start = self.position + self.rank * B * T
        buf = np.asarray(self._tokens[start : start + B * T + 1], dtype=np.int64)
        x = buf[:-1].reshape(B, T)
        y = buf[1:].reshape(B, T)
        self._advance()
        return x, y

    def _advance(self) -> None:
        position = self.position + self.tokens_per_step
        if position + self.tokens_per_step + 1 <= len(self._tokens):
            self.position = position
        elif self.shard_index + 1 < len(self.shards):
            self._enter(self.epoch, self.shard_index + 1, 0)
        else:
            self._enter(self.epoch + 1, 0, 0)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from, plus what must match to resume; JSON-able."""
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "shard_index": self.shard_index,
            "position": self.position,
            "shard": self.current_shard.name,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "num_shards": len(self.shards),
            "shards_digest": self.shards_digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a loader over the same shards and
        settings; the rank may differ, since every rank saves the same state)."""
        if state.get("format") != STATE_FORMAT:
            raise LoaderError(
                f"TokenLoader.load_state_dict: expected format {STATE_FORMAT!r}, "
                f"received {state.get('format')!r}"
            )
        mine = self.state_dict()
        for key in _FIXED_KEYS:
            if state.get(key) != mine[key]:
                raise LoaderError(
                    f"TokenLoader.load_state_dict: saved {key} is {state.get(key)!r} but this loader's is "
                    f"{mine[key]!r}; a state resumes only a loader over the same shards and settings"
                )
        epoch, shard_index, position = (state.get(k) for k in ("epoch", "shard_index", "position"))
        if not (isinstance(epoch, int) and epoch >= 0):
            raise LoaderError(
                f"TokenLoader.load_state_dict: epoch must be an integer >= 0, received {epoch!r}"
            )
        if not (isinstance(shard_index, int) and 0 <= shard_index < len(self.shards)):
            raise LoaderError(
                f"TokenLoader.load_state_dict: shard_index must be in [0, {len(self.shards) - 1}], "
                f"received {shard_index!r}"
            )
        length = self.shard_lengths[int(self._order(epoch)[shard_index])]
        stride = self.tokens_per_step
        if not (
            isinstance(position, int)
            and position >= 0
            and position % stride == 0
            and position + stride + 1 <= length
        ):
            raise LoaderError(
                f"TokenLoader.load_state_dict: position must be a multiple of {stride} with room for a step "
                f"in a shard of {length} tokens, received {position!r}"
            )
        self._enter(epoch, shard_index, position)
