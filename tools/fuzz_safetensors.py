"""Mutation fuzzer of the safetensors reader, ``blutrain.tensor.load_file``, and the mutators that every
fuzzer of a safetensors-based format shares (tools/fuzz_checkpoint.py builds on them).

The reader's contract: any file either loads or raises ``blutrain.tensor.SerializationError`` naming the
file and what is wrong. Anything else it raises (``KeyError``, ``TypeError``, ``IndexError``,
``RecursionError``, ``MemoryError``, a NumPy error, ...) is a crash, i.e. a bug.

Inputs start from a seed corpus of valid files written by ``save_file`` (every dtype, 0-d and empty
tensors, metadata) and get one to three stacked mutations:

- bytes: truncation, bit flips, bytes set to boundary values, chunks deleted, duplicated or inserted,
  the 8-byte header length changed, two corpus files spliced;
- header: the JSON re-encoded after a structural change of one entry (dtype, shape, data_offsets set to
  wrong values or types, keys removed or added, entries dropped, duplicated or swapped, the metadata
  made a non-object or given non-string values), the length prefix sometimes left stale, the whole
  header replaced by a non-object or by bytes the reader must refuse (not UTF-8, deep nesting, numbers
  with too many digits, duplicate keys).

A format that keeps something derived from the header or the data (the checkpoint's SHA-256 digests)
passes a :data:`HeaderFix` to :func:`mutators`; the structural mutators call it after their edit, so
that the checks behind it are reached too.

    python tools/fuzz_safetensors.py --inputs 1000000 --workers 2     # the full run (not in CI)
    python tools/fuzz_safetensors.py --inputs 20000 --seed 7           # a quick one

Prints inputs, seconds, inputs/s, how many loaded and how many were rejected, and every crash
signature with its mutations; crashing inputs are written to ``--crashes DIR``; exits 1 on a crash.
Writes a JSON summary with ``--json PATH``. The short CI run lives in
packages/blutrain-tensor/tests/test_fuzz_serialization.py and calls :func:`fuzz`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import blutrain.tensor as bt

Mutator = Callable[[random.Random, bytes, list[bytes]], bytes]
# called on the decoded header and the data region after a structural edit, before re-encoding
HeaderFix = Callable[[random.Random, dict[str, Any], bytes], None]

CODES = ["BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"]
ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 2**100, -(2**63), 1.5, float("nan"),
                         float("inf"), "", "x", "F32", [], [0], [-1], [1, 2, 3], [0, 2**64], {}, {"a": 1}, [[1]],
                         "0" * 40, [None, None], [1.0, 2.0], [True, False]]
_RAW_HEADERS = [b"\xff\xfe\x00", b"{\"a\":\xc3\x28}", b"[1,2", b"{}", b"[]", b"3", b"null", b"NaN",
                b"{\"__metadata__\": 5}", b"{\"__metadata__\": {\"k\": 1}}", b"{\"w\": 5}",
                b"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, \"w\": {}}",
                b"{\"w\": {\"dtype\": \"F32\", \"shape\": [" + b"9" * 5000 + b"], \"data_offsets\": [0, 4]}}",
                b"[" * 100_000, b"{\"a\":" * 5000 + b"1" + b"}" * 5000, b"{" * 5000, b"\"\\ud800\"",
                b"\"" + b"\\u0000" * 10 + b"\"",
                b"{\"w\": {\"dtype\": \"F32\", \"shape\": [" + b",".join([b"1"] * 200)
                + b"], \"data_offsets\": [0, 4]}}"]


# ------------------------------------------------------------------------------------------ corpus
def seed_cases() -> list[tuple[dict[str, bt.Tensor], dict[str, str] | None]]:
    """The tensors and metadata of the seed files."""
    import blutrain.tensor as bt

    rng = np.random.default_rng(0)
    return [
        ({"w": bt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)),
          "b": bt.from_numpy(rng.standard_normal(4).astype(np.float32))}, {"format": "pt"}),
        ({d.name: bt.arange(6).reshape(2, 3).to(dtype=d) for d in bt.ALL_DTYPES}, None),
        ({"scalar": bt.tensor(3.5), "empty": bt.zeros((0, 3)), "e2": bt.zeros((2, 0), dtype="int64"),
          "mask": bt.from_numpy(np.array([True, False, True]))}, {"a": "1", "b": "x"}),
        ({}, None),
    ]


def seed_corpus() -> list[bytes]:
    """Valid files written by the real writer, one per :func:`seed_cases` entry."""
    from blutrain.tensor import save_file

    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, (tensors, meta) in enumerate(seed_cases()):
            path = Path(d) / f"seed{i}.safetensors"
            save_file(tensors, path, metadata=meta)
            out.append(path.read_bytes())
    return out


# ------------------------------------------------------------------------------------------ header
def split_header(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """Header object and data region of a well-formed file, or None."""
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return (header, data[8 + n:]) if isinstance(header, dict) else None


def join_header(header: Any, body: bytes, length_error: int = 0) -> bytes:
    """The file of ``header`` (any JSON value) and ``body``; the length prefix off by ``length_error``."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return max(0, len(head) + length_error).to_bytes(8, "little") + head + body


def tensor_names(header: dict[str, Any]) -> list[str]:
    return [k for k in header if k != "__metadata__"]


# ------------------------------------------------------------------------------------------ byte mutators
def truncate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    return data[:rng.randrange(len(data) + 1)] if data else data


def bit_flips(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def set_bytes(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        buf[rng.randrange(len(buf))] = rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("["),
                                                   ord("9")])
    return bytes(buf)


def chunk_edit(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    if not data:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(16)))
    a = rng.randrange(len(data))
    b = min(len(data), a + rng.randint(1, 64))
    kind = rng.randrange(3)
    if kind == 0:
        return data[:a] + data[b:]
    if kind == 1:
        return data[:b] + data[a:b] + data[b:]
    return data[:a] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32))) + data[a:]


def header_length(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    n = int.from_bytes(data[:8].ljust(8, b"\0"), "little")
    # 100 MiB + 1: one past the largest header a reader accepts
    new = rng.choice([0, 1, 7, n - 1, n + 1, n + 8, len(data), len(data) - 8, 2**63, 2**64 - 1, 100 * 2**20 + 1])
    return int(new % 2**64).to_bytes(8, "little") + data[8:]


def splice(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    other = rng.choice(corpus)
    return data[:rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]


def raw_header(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    """A header of bytes that are not UTF-8 JSON, or JSON of a wrong kind, with a matching length."""
    head = rng.choice([*_RAW_HEADERS, bytes(rng.randrange(256) for _ in range(24))])
    body = data[8 + int.from_bytes(data[:8].ljust(8, b"\0"), "little"):] if len(data) >= 8 else b""
    return len(head).to_bytes(8, "little") + head + body


# ------------------------------------------------------------------------------------------ header mutators
def _shape_edit(rng: random.Random, shape: list[Any]) -> list[Any]:
    choice = rng.randrange(6)
    if choice == 0 and shape:
        shape[rng.randrange(len(shape))] = rng.choice([-1, 0, 1, 2**31, 2**62, 2**64, 3.0, True, "2"])
    elif choice == 1:
        shape.append(rng.choice([1, 2, 0, 10**6]))
    elif choice == 2:
        shape = shape[:-1]
    elif choice == 3:
        shape = shape[::-1]
    elif choice == 4:
        shape = [rng.randrange(1000) for _ in range(rng.randrange(5))]
    else:  # element counts or byte extents past what an array can address, or too many dimensions
        shape = rng.choice([[], [0, 2**62, 2**62], [2**40, 2**40], [1] * 40])
    return shape


def entry_field(rng: random.Random, data: bytes, corpus: list[bytes], fix: HeaderFix | None = None) -> bytes:
    parts = split_header(data)
    if parts is None or not tensor_names(parts[0]):
        return bit_flips(rng, data, corpus)
    header, body = parts
    name = rng.choice(tensor_names(header))
    info = header[name]
    if not isinstance(info, dict):
        header[name] = rng.choice(ODD_VALUES)
    else:
        key = rng.choice(["dtype", "shape", "data_offsets"])
        kind = rng.randrange(6)
        off = info.get("data_offsets")
        if kind == 0:
            info.pop(key, None)
        elif kind == 1:
            info[key] = rng.choice(ODD_VALUES)
        elif key == "dtype":
            info[key] = rng.choice([*CODES, "F8", "f32", "float32", "C64"])
        elif key == "shape" and isinstance(info.get("shape"), list):
            info[key] = _shape_edit(rng, list(info["shape"]))
        elif key == "data_offsets" and isinstance(off, list) and len(off) == 2 and all(type(o) is int for o in off):
            a, b = off
            d = rng.choice([-4, -1, 1, 2, 4, 2**40, 2**64])
            info[key] = rng.choice([[b, a], [a + d, b], [a, b + d], [0, b - a], [a, b, 0], [a], [str(a), b]])
        else:
            info["extra"] = 1
    if fix is not None:
        fix(rng, header, body)
    return join_header(header, body, rng.choice([-9, -1, 1, 8, 4096]) if rng.random() < 0.1 else 0)


def entries_edit(rng: random.Random, data: bytes, corpus: list[bytes], fix: HeaderFix | None = None) -> bytes:
    parts = split_header(data)
    if parts is None:
        return chunk_edit(rng, data, corpus)
    header, body = parts
    names = tensor_names(header)
    kind = rng.randrange(6)
    if kind == 0 and names:
        del header[rng.choice(names)]
    elif kind == 1 and names:
        header[f"{rng.choice(names)}.copy"] = header[rng.choice(names)]
    elif kind == 2 and len(names) >= 2:
        a, b = rng.sample(names, 2)
        header[a], header[b] = header[b], header[a]
    elif kind == 3:
        header["__metadata__"] = rng.choice([*ODD_VALUES, {"k": rng.choice(ODD_VALUES)}])
    elif kind == 4:
        return join_header(rng.choice([[], 3, "header", None, [header], {"__metadata__": header.get("__metadata__")}]),
                           body)
    else:
        body += bytes(rng.randint(1, 16))
    if fix is not None:
        fix(rng, header, body)
    return join_header(header, body)


def mutators(fix: HeaderFix | None = None) -> dict[str, Mutator]:
    """Every mutator by name, the header ones calling ``fix`` after their edit."""
    return {"truncate": truncate, "bit_flips": bit_flips, "set_bytes": set_bytes, "chunk_edit": chunk_edit,
            "header_length": header_length, "splice": splice, "entry_field": functools.partial(entry_field, fix=fix),
            "entries_edit": functools.partial(entries_edit, fix=fix), "raw_header": raw_header}


MUTATORS = mutators()
# structure-aware mutators are picked more often: they reach past the length and JSON checks
WEIGHTS = {"truncate": 1, "bit_flips": 2, "set_bytes": 1, "chunk_edit": 1, "header_length": 1, "splice": 1,
           "entry_field": 5, "entries_edit": 3, "raw_header": 2}


# ------------------------------------------------------------------------------------------ driver
@dataclass
class FuzzResult:
    inputs: int = 0
    loaded: int = 0
    rejected: int = 0
    seconds: float = 0.0
    crashes: dict[str, dict[str, Any]] = field(default_factory=dict)  # signature → first example

    def merge(self, other: FuzzResult) -> None:
        self.inputs += other.inputs
        self.loaded += other.loaded
        self.rejected += other.rejected
        for sig, example in other.crashes.items():
            self.crashes.setdefault(sig, example)


def _signature(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1] if frames else None
    place = f"{Path(where.filename).name}:{where.lineno}" if where else "?"
    return f"{type(exc).__name__} at {place}"


def fuzz_reader(read: Callable[[Path], object], error: type[Exception], corpus: list[bytes],
                mutations: dict[str, Mutator], weights: dict[str, int], inputs: int, seed: int,
                crashes_dir: Path | None) -> FuzzResult:
    """Run ``inputs`` mutated files through ``read`` in this process; whatever it raises other than ``error``
    naming the file is a crash."""
    rng = random.Random(seed)
    names = list(mutations)
    chances = [weights[n] for n in names]
    result = FuzzResult()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None) as d:
        path = Path(d) / "input.safetensors"
        start = time.perf_counter()
        for _ in range(inputs):
            data = rng.choice(corpus)
            applied = rng.choices(names, chances, k=rng.choice([1, 1, 2, 3]))
            for name in applied:
                data = mutations[name](rng, data, corpus)
            path.write_bytes(data)
            result.inputs += 1
            try:
                read(path)
                result.loaded += 1
            except error as exc:
                if str(path) not in str(exc):
                    sig = f"{error.__name__} without the file name"
                    result.crashes.setdefault(sig, {"mutations": applied, "message": str(exc)[:300]})
                result.rejected += 1
            except Exception as exc:  # the contract allows nothing else: every other type is a crash
                sig = _signature(exc)
                if sig not in result.crashes:
                    example = {"mutations": applied, "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    if crashes_dir is not None:
                        crashes_dir.mkdir(parents=True, exist_ok=True)
                        digest = hashlib.sha256(data).hexdigest()[:16]
                        (crashes_dir / f"crash-{digest}.safetensors").write_bytes(data)
                        example["file"] = str(crashes_dir / f"crash-{digest}.safetensors")
                    result.crashes[sig] = example
        result.seconds = time.perf_counter() - start
    return result


def fuzz(inputs: int, seed: int = 0, crashes_dir: Path | None = None,
         corpus: list[bytes] | None = None) -> FuzzResult:
    """Run ``inputs`` mutated files through ``load_file`` in this process."""
    from blutrain.tensor import SerializationError, load_file

    return fuzz_reader(load_file, SerializationError, corpus if corpus is not None else seed_corpus(), MUTATORS,
                       WEIGHTS, inputs, seed, crashes_dir)


# ------------------------------------------------------------------------------------------ command line
Fuzz = Callable[[int, int, Path | None], FuzzResult]


def _worker(job: tuple[Fuzz, int, int, str | None]) -> FuzzResult:
    run, inputs, seed, crashes = job
    return run(inputs, seed, Path(crashes) if crashes else None)


def cli(run: Fuzz, description: str, argv: list[str] | None = None) -> int:
    """The command line of a fuzzer whose in-process driver is ``run``: its inputs shared out among worker
    processes, the table printed, the JSON written; 1 on a crash."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--inputs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crashes", type=Path, default=Path("fuzz_crashes"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.inputs <= 0 or args.workers <= 0:
        parser.error(f"--inputs and --workers must be positive, got {args.inputs} and {args.workers}")
    shares = [args.inputs // args.workers + (i < args.inputs % args.workers) for i in range(args.workers)]
    jobs = [(run, n, args.seed * 1000 + i, str(args.crashes)) for i, n in enumerate(shares) if n]
    start = time.perf_counter()
    if len(jobs) == 1:
        parts = [_worker(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
            parts = pool.map(_worker, jobs)
    total = FuzzResult()
    for part in parts:
        total.merge(part)
    total.seconds = time.perf_counter() - start
    rate = total.inputs / total.seconds
    print(f"{'inputs':<12}{total.inputs:>14,}\n{'loaded':<12}{total.loaded:>14,}\n{'rejected':<12}"
          f"{total.rejected:>14,}\n{'seconds':<12}{total.seconds:>14.1f}\n{'inputs/s':<12}{rate:>14,.0f}\n"
          f"{'workers':<12}{len(jobs):>14}\n{'crashes':<12}{len(total.crashes):>14}")
    for sig, example in total.crashes.items():
        print(f"CRASH {sig}: {example}")
    if args.json:
        args.json.write_text(json.dumps({"inputs": total.inputs, "loaded": total.loaded, "rejected": total.rejected,
                                         "seconds": total.seconds, "inputs_per_s": rate, "workers": len(jobs),
                                         "crashes": total.crashes}, indent=1))
    return 1 if total.crashes else 0


def main(argv: list[str] | None = None) -> int:
    return cli(fuzz, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
