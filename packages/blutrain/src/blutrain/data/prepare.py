"""`prepare`: text files → train/val token shards, and the `blutrain prepare` subcommand.

Each input file is one document; as in llm.c's data scripts the eot token goes *before* every
document, so the stream starts with one and every boundary is marked. The last ``val_fraction`` of
the token stream becomes the validation split (it may start inside a document). Shards are
``train_000000.bin``, ... and ``val_000000.bin``, ... (see :mod:`blutrain.data.shard`), next to a
``dataset.json`` that records the tokenizer (and the ranks file it was read from) and the counts, read back
by :meth:`PrepareReport.read`. ``val_fraction`` 0 writes no validation split: the trainer then trains
without validation. The output directory is created only once every input is read and tokenized, so a bad
input leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from blutrain.data.errors import DataError, PrepareError
from blutrain.data.shard import MAX_TOKEN_ID, write_shard
from blutrain.data.tokenizer import TOKENIZER_NAMES, Tokenizer, get_tokenizer

DATASET_FILE = "dataset.json"
_SPLITS = ("train", "val")


def unigram_entropy_nats(tokens: NDArray[np.integer[Any]]) -> float:
    """Entropy of the tokens' own unigram distribution, in nats per token.

    No model that predicts each token from nothing can do better on these tokens, so a language
    model's validation loss (nats, as cross-entropy is) must end below it to have learnt context.
    """
    if len(tokens) == 0:
        raise PrepareError("unigram_entropy_nats: expected at least one token, received none")
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class PrepareReport:
    """What `prepare` wrote into ``out_dir``."""

    out_dir: Path
    tokenizer: str
    vocab_size: int
    eot_token: int
    documents: int
    text_bytes: int
    train_tokens: int
    val_tokens: int
    train_shards: tuple[Path, ...]
    val_shards: tuple[Path, ...]
    val_entropy_nats: float | None  # None when there is no validation split
    # the absolute path of the ranks file the tokenizer was read from (gpt2 with --tokenizer-file), so that
    # the trainer and `generate` read the same one; None: the byte tokenizer or tiktoken's cache
    tokenizer_file: str | None = None

    @property
    def val_entropy_bits(self) -> float | None:
        return None if self.val_entropy_nats is None else self.val_entropy_nats / math.log(2)

    @property
    def train_pattern(self) -> str:
        """Glob for the train shards, to give to :class:`TokenLoader`."""
        return str(self.out_dir / "train_*.bin")

    @property
    def val_pattern(self) -> str:
        return str(self.out_dir / "val_*.bin")

    def to_json(self) -> dict[str, Any]:
        # Shard names, not paths: the directory may be renamed (the corpus cache is built elsewhere).
        return {
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "eot_token": self.eot_token,
            "documents": self.documents,
            "text_bytes": self.text_bytes,
            "train_tokens": self.train_tokens,
            "val_tokens": self.val_tokens,
            "train_shards": [p.name for p in self.train_shards],
            "val_shards": [p.name for p in self.val_shards],
            "val_entropy_nats": self.val_entropy_nats,
            "tokenizer_file": self.tokenizer_file,
        }

    def write(self) -> None:
        (self.out_dir / DATASET_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def read(cls, out_dir: Path) -> PrepareReport:
        """The report `prepare` left in ``out_dir``."""
        path = Path(out_dir) / DATASET_FILE
        try:
            meta = json.loads(path.read_text())
            return cls(
                out_dir=Path(out_dir),
                tokenizer=str(meta["tokenizer"]),
                vocab_size=int(meta["vocab_size"]),
                eot_token=int(meta["eot_token"]),
                documents=int(meta["documents"]),
                text_bytes=int(meta["text_bytes"]),
                train_tokens=int(meta["train_tokens"]),
                val_tokens=int(meta["val_tokens"]),
                train_shards=tuple(Path(out_dir) / n for n in meta["train_shards"]),
                val_shards=tuple(Path(out_dir) / n for n in meta["val_shards"]),
                val_entropy_nats=None
                if meta["val_entropy_nats"] is None
                else float(meta["val_entropy_nats"]),
                tokenizer_file=None if meta.get("tokenizer_file") is None else str(meta["tokenizer_file"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PrepareError(
                f"dataset description {path} cannot be read ({type(e).__name__}: {e})"
            ) from None

    def summary(self) -> str:
        """Human-readable lines: the shards written, their token counts, the val baseline."""
        n_train, n_val = len(self.train_shards), len(self.val_shards)
        lines = [
            f"wrote {n_train} train shard(s) ({self.train_tokens:,} tokens) and {n_val} val shard(s) "
            f"({self.val_tokens:,} tokens) to {self.out_dir}",
            f"  from {self.documents} document(s), {self.text_bytes:,} bytes of text; "
            f"tokenizer {self.tokenizer} "
            f"(vocab_size {self.vocab_size}, eot {self.eot_token})"
            + (f" from {self.tokenizer_file}" if self.tokenizer_file else ""),
        ]
        if not self.val_shards:
            lines.append("  no validation split (val_fraction 0): `blutrain train` on it reports no validation loss")
        if self.val_entropy_nats is not None:
            lines.append(
                f"  val unigram entropy: {self.val_entropy_bits:.4f} bits/token = "
                f"{self.val_entropy_nats:.4f} nats/token (the loss to beat)"
            )
        return "\n".join(lines)


def _write_split(
    out_dir: Path, split: str, tokens: NDArray[np.uint16], shard_tokens: int
) -> tuple[Path, ...]:
    return tuple(
        write_shard(out_dir / f"{split}_{i:06d}.bin", tokens[start : start + shard_tokens])
        for i, start in enumerate(range(0, len(tokens), shard_tokens))
    )


def _read_document(path: Path) -> str:
    if not path.is_file():
        what = "is a directory; pass the text files in it" if path.is_dir() else "does not exist"
        raise PrepareError(f"prepare: input {path} {what}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(
            f"prepare: input {path} is not UTF-8 text: byte {data[e.start]:#04x} at offset {e.start}"
        ) from None


def prepare(
    inputs: Sequence[Path],
    out_dir: Path,
    tokenizer: Tokenizer,
    val_fraction: float,
    shard_tokens: int = 100_000_000,
    *,
    overwrite: bool = False,
    tokenizer_file: str | Path | None = None,
) -> PrepareReport:
    """Tokenize the UTF-8 text files ``inputs`` into train/val shards in ``out_dir``.

    ``val_fraction`` in [0, 1): the share of tokens, taken from the end, that becomes validation (0: no
    validation split). ``shard_tokens``: tokens per shard (the last one of a split is shorter). Shards
    already in ``out_dir`` are an error unless ``overwrite``, which deletes them (only once the new ones
    are ready to be written), so stale shards of an earlier run never mix with new ones.
    ``tokenizer_file``: the ranks file ``tokenizer`` was read from, recorded (absolute) in dataset.json.
    Nothing is created before every input has been read and tokenized: a bad input leaves no directory.
    """
    out_dir = Path(out_dir)
    if not inputs:
        raise PrepareError("prepare: expected at least one input file, received none")
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"prepare: val_fraction must be in [0, 1), received {val_fraction}")
    if shard_tokens < 1:
        raise PrepareError(f"prepare: shard_tokens must be >= 1, received {shard_tokens}")
    if tokenizer.vocab_size > MAX_TOKEN_ID + 1:
        raise PrepareError(
            f"prepare: tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids; shards store uint16, "
            f"so at most {MAX_TOKEN_ID + 1}"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"prepare: --out {out_dir} is a file; expected a directory (new or holding shards to "
                           "replace with --overwrite); choose another path")
    stale = sorted(p for split in _SPLITS for p in out_dir.glob(f"{split}_*.bin")) if out_dir.is_dir() else []
    if stale and not overwrite:
        raise PrepareError(
            f"prepare: output directory {out_dir} already holds {len(stale)} shard(s) "
            f"({stale[0].name}, ...); "
            "choose an empty directory or pass --overwrite to delete them"
        )

    documents: list[NDArray[np.uint16]] = []
    text_bytes = 0
    for path in inputs:
        text = _read_document(Path(path))
        text_bytes += len(text.encode("utf-8"))
        ids = tokenizer.encode(text)
        doc = np.empty(len(ids) + 1, dtype=np.uint16)
        doc[0] = tokenizer.eot_token
        doc[1:] = ids
        documents.append(doc)
    tokens = np.concatenate(documents)
    n_val = round(len(tokens) * val_fraction)
    if n_val == len(tokens):
        raise PrepareError(
            f"prepare: val_fraction={val_fraction} of {len(tokens)} tokens leaves none for training"
        )
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"prepare: cannot create output directory {out_dir}: {e.strerror or e}") from None
    for p in stale:
        p.unlink()
    (out_dir / DATASET_FILE).unlink(missing_ok=True)
    report = PrepareReport(
        out_dir=out_dir,
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eot_token=tokenizer.eot_token,
        documents=len(documents),
        text_bytes=text_bytes,
        train_tokens=len(train),
        val_tokens=len(val),
        train_shards=_write_split(out_dir, "train", train, shard_tokens),
        val_shards=_write_split(out_dir, "val", val, shard_tokens),
        val_entropy_nats=unigram_entropy_nats(val) if len(val) else None,
        tokenizer_file=None if tokenizer_file is None else str(Path(tokenizer_file).resolve()),
    )
    report.write()
    return report


def add_prepare_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``prepare INPUT... --out DIR --tokenizer byte|gpt2 [--tokenizer-file PATH] --val-fraction F``.

    The handler is stored as the parser default ``func``: ``args.func(args)`` returns the exit code.
    """
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize text files into train/val token shards",
        description="Tokenize UTF-8 text files (one document each) into llm.c-format train/val token shards.",
    )
    parser.add_argument(
        "inputs", nargs="+", type=Path, metavar="INPUT", help="UTF-8 text files, one document each"
    )
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the shards")
    parser.add_argument("--tokenizer", required=True, choices=TOKENIZER_NAMES)
    parser.add_argument(
        "--tokenizer-file",
        type=Path,
        metavar="PATH",
        help="gpt2 only: a .tiktoken BPE ranks file (default: look in tiktoken's cache; never downloads); "
        "recorded in DIR/dataset.json, where `blutrain train` and `generate` find it",
    )
    parser.add_argument(
        "--val-fraction",
        required=True,
        type=float,
        metavar="F",
        help="share of tokens, from the end, kept for val (0: no validation split)",
    )
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N", help="tokens per shard")
    parser.add_argument("--overwrite", action="store_true", help="delete shards already in DIR")
    parser.set_defaults(func=run_prepare_command)
    return parser


def run_prepare_command(args: argparse.Namespace) -> int:
    """The ``prepare`` subcommand: prints what it wrote, returns 0; on a data error prints it, returns 1."""
    try:
        tokenizer = get_tokenizer(args.tokenizer, args.tokenizer_file)
        report = prepare(
            args.inputs,
            args.out,
            tokenizer,
            args.val_fraction,
            args.shard_tokens,
            overwrite=args.overwrite,
            tokenizer_file=args.tokenizer_file,
        )
    except DataError as e:
        print(f"blutrain prepare: error: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    for shard in report.train_shards + report.val_shards:
        print(f"  {shard}")
    return 0
