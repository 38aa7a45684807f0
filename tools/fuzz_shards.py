"""Mutation fuzzer for the token-shard reader (``blutrain.data.read_shard``) and ``TokenLoader``.

Each input is a valid shard from a seed corpus (written by ``write_shard``: 0 to 1000 tokens, small
and full-range ids) with one to three mutations stacked: truncation, extension, bit flips, byte
overwrites, header fields (magic, version, count, reserved) set to edge values, the count made to
match another size, token ids above the vocabulary, splices of two shards, the empty file. The
input is written to a file on tmpfs, then

1. ``read_shard`` must either accept it or raise ``ShardError``; what it accepts must be exactly
   what an independent parse of the format (``struct``, below) accepts, with the same tokens;
2. ``TokenLoader(file, B, T, vocab_size=V)`` plus one batch must succeed when the shard is valid,
   holds at least ``B*T + 1`` tokens and no id ``>= V`` (and then give the first ``B*T`` tokens), and
   raise ``ShardError`` / ``LoaderError`` otherwise.

Any other exception is a *crash*, any disagreement with the oracle a *mismatch*; both are bugs.
Each is saved under ``--out`` as the input file plus its traceback. Inputs are reproducible: input
``i`` of chunk ``c`` comes from ``random.Random(f"{seed}:{c}")``.

    python tools/fuzz_shards.py                  # 1,000,000 inputs on every core
    python tools/fuzz_shards.py --inputs 20000 --workers 1 --seed 7

Prints a table last and writes ``fuzz_shards.json`` to ``--out`` (default ``$OUT``, else
``tools/results/fuzz_shards/``). Not part of CI; ``packages/blutrain/tests/data/test_fuzz_shards.py``
runs the same fuzzer on a few thousand inputs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from blutrain.data import SHARD_MAGIC, SHARD_VERSION, DataError, LoaderError, TokenLoader, read_shard, write_shard

HEADER_BYTES = 1024
CHUNK = 5_000  # inputs per work item; one Random per chunk
INT32_EDGES = (0, 1, 2, -1, -2, 2**31 - 1, -(2**31), 2**16, 2**30, SHARD_MAGIC, SHARD_VERSION)
Reader = Callable[[Path], Any]


def seed_corpus() -> list[bytes]:
    """Valid shards, as ``write_shard`` writes them."""
    rng = np.random.default_rng(0)
    shards: list[bytes] = []
    with tempfile.TemporaryDirectory() as d:
        for n in (0, 1, 2, 7, 17, 64, 257, 1000):
            for high in (256, 65536):
                path = write_shard(Path(d) / "s.bin", rng.integers(0, high, n))
                shards.append(path.read_bytes())
    return shards


# --- the oracle: the format, parsed independently of blutrain.data ---------------------------------------------


def parse(data: bytes) -> list[int] | None:
    """The tokens of a valid shard, else None: header of 256 little-endian int32 (magic, version,
    count >= 0, ...), then exactly ``count`` little-endian uint16."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, count = struct.unpack_from("<iii", data)
    if magic != SHARD_MAGIC or version != SHARD_VERSION or count < 0 or len(data) != HEADER_BYTES + 2 * count:
        return None
    return list(struct.unpack_from(f"<{count}H", data, HEADER_BYTES))


# --- mutations ---------------------------------------------------------------------------------------------------


def _count(data: bytes) -> int:
    return struct.unpack_from("<i", data, 8)[0] if len(data) >= 12 else 0


def _set_int(data: bytearray, index: int, value: int) -> bytearray:
    if len(data) < 4 * index + 4:
        data.extend(b"\0" * (4 * index + 4 - len(data)))
    struct.pack_into("<i", data, 4 * index, (value + 2**31) % 2**32 - 2**31)  # wrapped into int32
    return data


def truncate(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    n = len(data)
    cut = rng.choice([rng.randrange(n + 1), rng.randrange(min(n, HEADER_BYTES) + 1), HEADER_BYTES, n - 1, n - 2])
    return data[: max(cut, 0)]


def extend(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    return data + rng.randbytes(rng.choice([1, 2, 3, rng.randrange(1, 4096)]))


def flip_bits(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    if not data:
        return data
    for _ in range(rng.randrange(1, 9)):
        pos = rng.randrange(min(12, len(data))) if rng.random() < 0.5 else rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
    return data


def set_bytes(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    if not data:
        return data
    for _ in range(rng.randrange(1, 5)):
        data[rng.randrange(len(data))] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
    return data


def header_field(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    index = rng.choice([0, 1, 2, 2, 2])
    count = _count(bytes(data))
    body = (len(data) - HEADER_BYTES) // 2
    value = rng.choice([*INT32_EDGES, count + 1, count - 1, 2 * count, body, body + 1, rng.randrange(-(2**31), 2**31)])
    return _set_int(data, index, value)


def match_count(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    """A consistent header for a new size: the file stays valid, its length changes."""
    count = rng.choice([0, 1, rng.randrange(0, 2000)])
    body = bytes(data[HEADER_BYTES:])
    body = (body + rng.randbytes(max(0, 2 * count - len(body))))[: 2 * count]
    return _set_int(bytearray(data[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")), 2, count) + body


def large_ids(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    for _ in range(rng.randrange(1, 4)):
        if len(data) >= HEADER_BYTES + 2:
            pos = HEADER_BYTES + 2 * rng.randrange((len(data) - HEADER_BYTES) // 2)
            struct.pack_into("<H", data, pos, rng.choice([255, 256, 50256, 50257, 65535, rng.randrange(65536)]))
    return data


def splice(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    other = rng.choice(corpus)
    cut = rng.randrange(min(len(data), len(other)) + 1)
    return data[:cut] + other[cut:]


def reserved(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    return _set_int(data, rng.randrange(3, 256), rng.choice(INT32_EDGES))


def empty(rng: random.Random, data: bytearray, corpus: list[bytes]) -> bytearray:
    return bytearray()


MUTATORS = (truncate, extend, flip_bits, set_bytes, header_field, header_field, match_count, large_ids, splice,
            reserved, empty)


def mutate(rng: random.Random, corpus: list[bytes]) -> bytes:
    data = bytearray(rng.choice(corpus))
    if rng.random() < 0.05:
        return bytes(data)  # unmutated inputs keep the accepting path covered
    for _ in range(rng.choice([1, 1, 2, 3])):
        data = rng.choice(MUTATORS)(rng, data, corpus)
    return bytes(data)


# --- one input ---------------------------------------------------------------------------------------------------


class OracleMismatchError(AssertionError):
    """The reader or the loader disagreed with the oracle."""


def check(data: bytes, path: Path, batch: int, seq: int, vocab: int, reader: Reader = read_shard) -> str:
    """Run one input through the reader and the loader; the outcome's name. Raises on a bug."""
    path.write_bytes(data)
    expected = parse(data)
    try:
        tokens = reader(path)
    except DataError as e:
        if expected is not None:
            raise OracleMismatchError(f"the reader refused a valid shard: {e}") from None
        return f"reader:{type(e).__name__}"
    got = np.asarray(tokens).tolist()
    del tokens  # unmap before the file is rewritten
    if expected is None:
        raise OracleMismatchError("the reader accepted an invalid shard")
    if got != expected:
        raise OracleMismatchError("the reader returned other tokens than the file holds")
    need = batch * seq + 1
    should_load = len(expected) >= need and max(expected, default=0) < vocab
    try:
        loader = TokenLoader(path, batch, seq, vocab_size=vocab)
        x, _ = loader.next_batch()
        first = x.ravel().tolist()
        del loader
    except LoaderError as e:
        if should_load:
            raise OracleMismatchError(f"the loader refused a shard that fits: {e}") from None
        return "loader:LoaderError"
    if not should_load:
        raise OracleMismatchError(f"the loader took a shard of {len(expected)} tokens (need {need}, vocab {vocab})")
    if first != expected[: batch * seq]:
        raise OracleMismatchError("the loader's first batch is not the shard's first tokens")
    return "accepted"


@dataclass
class Report:
    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: list[dict[str, str]] = field(default_factory=list)  # the first few, with their tracebacks

    def merge(self, other: Report) -> None:
        self.inputs += other.inputs
        self.outcomes.update(other.outcomes)
        self.crashes.extend(other.crashes[: max(0, 20 - len(self.crashes))])

    @property
    def bugs(self) -> int:
        return self.outcomes["crash"] + self.outcomes["mismatch"]


def run_chunk(seed: int, chunk: int, count: int, save_dir: str | None = None,
              reader: Reader = read_shard) -> Report:
    """Fuzz ``count`` inputs of chunk ``chunk``; crashes are saved to ``save_dir`` when given."""
    rng = random.Random(f"{seed}:{chunk}")
    corpus = seed_corpus()
    report = Report()
    tmp_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=tmp_root, prefix="fuzz_shards.") as d:
        path = Path(d) / "input.bin"
        for i in range(count):
            data = mutate(rng, corpus)
            batch, seq, vocab = rng.choice([1, 2]), rng.choice([1, 3, 8]), rng.choice([256, 50257, 65536])
            try:
                outcome = check(data, path, batch, seq, vocab, reader)
            except Exception as e:  # every exception that is not a documented one is the finding
                outcome = "mismatch" if isinstance(e, OracleMismatchError) else "crash"
                name = f"{outcome}-{seed}-{chunk}-{i}"
                found = {"input": name, "kind": outcome, "error": f"{type(e).__name__}: {e}",
                         "loader": f"B={batch} T={seq} vocab={vocab}", "traceback": traceback.format_exc()}
                if len(report.crashes) < 20:
                    report.crashes.append(found)
                if save_dir is not None:
                    Path(save_dir, f"{name}.bin").write_bytes(data)
                    Path(save_dir, f"{name}.txt").write_text(json.dumps(found, indent=1))
            report.outcomes[outcome] += 1
            report.inputs += 1
    return report


def _run_chunk_args(args: tuple[int, int, int, str | None]) -> Report:
    return run_chunk(*args)


def fuzz(inputs: int, workers: int, seed: int, save_dir: str | None) -> Report:
    chunks = [(seed, c, min(CHUNK, inputs - c * CHUNK), save_dir) for c in range((inputs + CHUNK - 1) // CHUNK)]
    total = Report()
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for done, part in enumerate(pool.imap_unordered(_run_chunk_args, chunks), start=1):
            total.merge(part)
            if done % max(1, len(chunks) // 20) == 0 or done == len(chunks):
                rate = total.inputs / (time.perf_counter() - start)
                print(f"  {total.inputs:>9,} inputs  {rate:>8,.0f}/s  bugs {total.bugs}", file=sys.stderr, flush=True)
    total.seconds = time.perf_counter() - start
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else
                        Path(__file__).parent / "results" / "fuzz_shards")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = fuzz(args.inputs, args.workers, args.seed, str(args.out))
    result = {"inputs": report.inputs, "seconds": round(report.seconds, 2),
              "inputs_per_s": round(report.inputs / report.seconds), "workers": args.workers, "seed": args.seed,
              "outcomes": dict(sorted(report.outcomes.items())), "bugs": report.bugs, "first_bugs": report.crashes}
    (args.out / "fuzz_shards.json").write_text(json.dumps(result, indent=1))
    for found in report.crashes[:5]:
        print(f"\n{found['input']} ({found['loader']}): {found['error']}\n{found['traceback']}")
    print(f"\n{'outcome':<28}{'inputs':>12}")
    for name, n in sorted(report.outcomes.items()):
        print(f"{name:<28}{n:>12,}")
    print(f"{'total':<28}{report.inputs:>12,}")
    print(f"\n{report.inputs:,} inputs in {report.seconds:.1f} s = {result['inputs_per_s']:,} inputs/s on "
          f"{args.workers} workers; crashes {report.outcomes['crash']}, mismatches {report.outcomes['mismatch']}; "
          f"{args.out / 'fuzz_shards.json'}")
    return 1 if report.bugs else 0


if __name__ == "__main__":
    sys.exit(main())
