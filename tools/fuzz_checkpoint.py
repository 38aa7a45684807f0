"""Mutation fuzzer of the checkpoint reader, ``blutrain.train.load_checkpoint``.

The reader's contract: any file either loads or raises ``blutrain.train.CheckpointError`` naming the
file and what is wrong. Anything else it raises (``KeyError``, ``TypeError``, ``RecursionError``,
``MemoryError``, a NumPy error, ...) is a crash, i.e. a bug.

Inputs start from a seed corpus of valid checkpoints (every dtype, 0-d and empty tensors, nested
optimizer state) written by ``save_checkpoint``, and get one to three stacked mutations:

- bytes: truncation, bit flips, bytes set to boundary values, chunks deleted, duplicated or inserted,
  the 8-byte header length changed, two corpus files spliced;
- header: the JSON re-encoded after a structural change of one entry (dtype, shape, data_offsets set to
  wrong values or types, keys removed or added, entries dropped or duplicated), the whole header
  replaced by a non-object or by bytes that are not UTF-8, the length prefix left stale;
- metadata: entries removed, made non-strings, or their JSON replaced by invalid JSON, deep nesting,
  numbers with too many digits, wrong types, dangling ``__tensor__`` references, bad trainer steps,
  a wrong format or altered checksums;
- and, for most header and metadata mutations, the SHA-256 entries (the tensors' and the metadata's
  own) recomputed after the change, so that the checks behind the checksums (dtype content, the
  states' structure) are reached too.

    python tools/fuzz_checkpoint.py --inputs 1000000 --workers 2     # the full run (not in CI)
    python tools/fuzz_checkpoint.py --inputs 20000 --seed 7           # a quick one

Prints inputs, seconds, inputs/s, how many loaded and how many were rejected, and every crash
signature with its mutations; crashing inputs are written to ``--crashes DIR``; exits 1 on a crash.
Writes a JSON summary with ``--json PATH``. The short CI run lives in
packages/blutrain/tests/train/test_fuzz_checkpoint.py and calls :func:`fuzz`.
"""

from __future__ import annotations

import argparse
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
from typing import Any

import numpy as np

Mutator = Callable[[random.Random, bytes, list[bytes]], bytes]

_CODES = ["BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"]
_ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 2**100, -(2**63), 1.5, float("nan"),
                          "", "x", "F32", [], [0], [1, 2, 3], {}, {"a": 1}, [[1]], "0" * 40]


# ------------------------------------------------------------------------------------------ corpus
def seed_corpus() -> list[bytes]:
    """Valid checkpoints written by the real writer."""
    import blutrain.tensor as bt
    from blutrain.train.checkpoint import save_checkpoint

    rng = np.random.default_rng(0)
    cases: list[dict[str, bt.Tensor]] = [
        {"w": bt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)),
         "b": bt.from_numpy(rng.standard_normal(4).astype(np.float32))},
        {"h": bt.from_numpy(rng.standard_normal((2, 3)).astype(np.float32)).to(dtype="bfloat16"),
         "half": bt.from_numpy(rng.standard_normal(5).astype(np.float16)),
         "d": bt.from_numpy(rng.standard_normal((1, 2)))},
        {"ids": bt.arange(7, dtype="int64"), "mask": bt.from_numpy(np.array([True, False, True])),
         "u8": bt.from_numpy(np.arange(5, dtype=np.uint8)), "i8": bt.from_numpy(np.arange(-2, 3, dtype=np.int8)),
         "i16": bt.from_numpy(np.arange(3, dtype=np.int16)), "i32": bt.from_numpy(np.arange(4, dtype=np.int32))},
        {"scalar": bt.tensor(3.5), "empty": bt.zeros((0, 3)), "e2": bt.zeros((2, 0), dtype="int64")},
        {},
    ]
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, model in enumerate(cases):
            optim: dict[str, Any] = {"state": {str(k): {"step": k + 1, "exp_avg": bt.ones((2,)) * k}
                                               for k in range(i % 3)},
                                     "param_groups": [{"lr": 0.1, "betas": [0.9, 0.95], "params": [0, 1]}]}
            path = Path(d) / f"seed{i}.safetensors"
            save_checkpoint(path, model_state=model, optimizer_state=optim,
                            trainer_state={"step": i, "val_history": [[1, 2.5]]},
                            loader_state={"epoch": 0, "position": i}, rng_state={"cpu": {"key": [1, 2]}},
                            config={"train": {"batch_size": 4}, "model": {"n_layer": 1}})
            out.append(path.read_bytes())
    return out


# ------------------------------------------------------------------------------------------ helpers
def _split(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """Header object and data region of a well-formed file, or None."""
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return (header, data[8 + n:]) if isinstance(header, dict) else None


def _join(header: Any, body: bytes, rng: random.Random, stale_length: bool = False) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    n = len(head)
    if stale_length:
        n = max(0, n + rng.choice([-9, -1, 1, 8, 4096]))
    return n.to_bytes(8, "little") + head + body


def _fix_metadata_digest(header: dict[str, Any]) -> None:
    """Recompute the metadata's own SHA-256 (of every other entry, as sorted JSON), as the writer does."""
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and "metadata_sha256" in meta:
        body = json.dumps({k: v for k, v in meta.items() if k != "metadata_sha256"}, sort_keys=True)
        meta["metadata_sha256"] = hashlib.sha256(body.encode()).hexdigest()


def _fix_digests(header: dict[str, Any], body: bytes) -> None:
    """Recompute the stored SHA-256 of every entry whose offsets lie inside the data region, then the
    metadata's own."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        return
    digests = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        off = info.get("data_offsets")
        if isinstance(off, list) and len(off) == 2 and all(type(o) is int for o in off) and 0 <= off[0] <= off[1]:
            digests[name] = hashlib.sha256(body[off[0]:off[1]]).hexdigest()
    meta["sha256"] = json.dumps(digests, sort_keys=True)
    _fix_metadata_digest(header)


def _tensor_names(header: dict[str, Any]) -> list[str]:
    return [k for k in header if k != "__metadata__"]


# ------------------------------------------------------------------------------------------ mutators
def truncate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    return data[:rng.randrange(len(data) + 1)] if data else data


def bit_flips(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def set_bytes(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        buf[rng.randrange(len(buf))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("["), ord("9")])
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
    new = rng.choice([0, 1, 7, n - 1, n + 1, n + 8, len(data), len(data) - 8, 2**63, 2**64 - 1, 100 * 2**20 + 1])
    return int(new % 2**64).to_bytes(8, "little") + data[8:]


def splice(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    other = rng.choice(corpus)
    return data[:rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]


def entry_field(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    parts = _split(data)
    if parts is None or not _tensor_names(parts[0]):
        return bit_flips(rng, data, corpus)
    header, body = parts
    name = rng.choice(_tensor_names(header))
    info = header[name]
    if not isinstance(info, dict):
        header[name] = rng.choice(_ODD_VALUES)
    else:
        key = rng.choice(["dtype", "shape", "data_offsets"])
        kind = rng.randrange(6)
        if kind == 0:
            info.pop(key, None)
        elif kind == 1:
            info[key] = rng.choice(_ODD_VALUES)
        elif key == "dtype":
            info[key] = rng.choice([*_CODES, "F8", "f32", "float32", "C64"])
        elif key == "shape" and isinstance(info.get("shape"), list):
            shape = list(info["shape"])
            choice = rng.randrange(5)
            if choice == 0 and shape:
                shape[rng.randrange(len(shape))] = rng.choice([-1, 0, 1, 2**62, 2**64, 3.0, True, "2"])
            elif choice == 1:
                shape.append(rng.choice([1, 2, 0, 10**6]))
            elif choice == 2:
                shape = shape[:-1]
            elif choice == 3:
                shape = shape[::-1]
            else:
                shape = [rng.randrange(1000) for _ in range(rng.randrange(5))]
            info[key] = shape
        elif key == "data_offsets" and isinstance(info.get("data_offsets"), list):
            off = list(info["data_offsets"])
            if len(off) == 2 and all(type(o) is int for o in off):
                choice = rng.randrange(5)
                if choice == 0:
                    off = [off[1], off[0]]
                elif choice == 1:
                    off = [off[0] + rng.choice([-4, -1, 1, 2, 4]), off[1]]
                elif choice == 2:
                    off = [off[0], off[1] + rng.choice([-4, -1, 1, 2, 4, 2**40])]
                elif choice == 3:
                    off = [0, off[1] - off[0]]
                else:
                    off = [*off, 0]
            info[key] = off
        else:
            info["extra"] = 1
    if rng.random() < 0.5:
        _fix_digests(header, body)
    return _join(header, body, rng, stale_length=rng.random() < 0.1)


def entries_edit(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    parts = _split(data)
    if parts is None:
        return chunk_edit(rng, data, corpus)
    header, body = parts
    names = _tensor_names(header)
    kind = rng.randrange(5)
    if kind == 0 and names:
        del header[rng.choice(names)]
    elif kind == 1 and names:
        header[f"{rng.choice(names)}.copy"] = header[rng.choice(names)]
    elif kind == 2 and len(names) >= 2:
        a, b = rng.sample(names, 2)
        header[a], header[b] = header[b], header[a]
    elif kind == 3:
        replacement: Any = rng.choice([[], 3, "header", None, [header], {"__metadata__": header.get("__metadata__")}])
        return _join(replacement, body, rng)
    else:
        body = body + bytes(rng.randint(1, 16))
    if isinstance(header, dict) and rng.random() < 0.5:
        _fix_digests(header, body)
    return _join(header, body, rng)


def _metadata_text(rng: random.Random, header: dict[str, Any]) -> str:
    names = _tensor_names(header)
    ref = rng.choice(names) if names else "model.w"
    return rng.choice([
        "", "{", "[" * 100_000, "{\"a\":" * 5000 + "1" + "}" * 5000, "1" * 5000, "null", "3", "[]", "\"x\"",
        "{\"step\": -1}", "{\"step\": \"3\"}", "{\"step\": 1.5}", "{\"step\": true}", "{\"step\": 1e400}",
        "{\"step\": " + "9" * 30 + "}", "{\"step\": 1, \"val_history\": [[1]]}",
        "{\"step\": 1, \"val_history\": 3}", "{\"step\": 1, \"skipped_steps\": [1.5]}",
        "{\"state\": {\"0\": {\"m\": {\"__tensor__\": \"nope\"}}}}",
        "{\"x\": {\"__tensor__\": 5}}", "{\"x\": {\"__tensor__\": \"" + ref + "\", \"more\": 1}}",
        "{\"x\": {\"__tensor__\": \"" + ref + "\"}}", "[" * 70 + "]" * 70, "{\"a\": NaN}", "\"\\ud800\"",
        json.dumps({f"model.{i}": "00" for i in range(3)}),
    ])


def metadata_edit(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    parts = _split(data)
    if parts is None:
        return bit_flips(rng, data, corpus)
    header, body = parts
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        header["__metadata__"] = rng.choice(_ODD_VALUES)
        return _join(header, body, rng)
    key = rng.choice(["format", "optimizer", "trainer", "loader", "rng", "config", "sha256", "metadata_sha256",
                      "extra"])
    kind = rng.randrange(4)
    if kind == 0:
        meta.pop(key, None)
    elif kind == 1:
        meta[key] = rng.choice(_ODD_VALUES)
    elif key == "sha256" and kind == 2 and isinstance(meta.get("sha256"), str):
        try:
            digests = json.loads(meta["sha256"])
        except (ValueError, RecursionError):
            digests = {}
        if isinstance(digests, dict) and digests:
            victim = rng.choice(sorted(digests))
            digests[victim] = rng.choice(["", "0" * 64, 5, None, str(digests[victim])[::-1]])
            if rng.random() < 0.5:
                digests[victim + "x"] = digests.pop(victim)
        meta["sha256"] = json.dumps(digests)
    elif key == "format" and kind == 2:
        meta[key] = rng.choice(["blutrain-checkpoint-0", "blutrain-checkpoint-2", "pt", ""])
    else:
        meta[key] = _metadata_text(rng, header)
    if rng.random() < 0.7:
        _fix_metadata_digest(header)
    return _join(header, body, rng)


def raw_header(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    """A header of bytes that are not UTF-8 JSON, or JSON of a wrong kind, with a matching length."""
    noise = bytes(rng.randrange(256) for _ in range(24))
    head = rng.choice([b"\xff\xfe\x00", b"{\"a\":\xc3\x28}", b"[1,2", b"{}", b"{\"__metadata__\": 5}",
                       b"NaN", b"{" * 5000, b"\"" + b"\\u0000" * 10 + b"\"", noise])
    body = data[8 + int.from_bytes(data[:8].ljust(8, b"\0"), "little"):] if len(data) >= 8 else b""
    return len(head).to_bytes(8, "little") + head + body


MUTATORS: dict[str, Mutator] = {
    "truncate": truncate, "bit_flips": bit_flips, "set_bytes": set_bytes, "chunk_edit": chunk_edit,
    "header_length": header_length, "splice": splice, "entry_field": entry_field, "entries_edit": entries_edit,
    "metadata_edit": metadata_edit, "raw_header": raw_header,
}
# structure-aware mutators are picked more often: they reach past the header checks
_WEIGHTS = {"truncate": 1, "bit_flips": 2, "set_bytes": 1, "chunk_edit": 1, "header_length": 1, "splice": 1,
            "entry_field": 4, "entries_edit": 2, "metadata_edit": 4, "raw_header": 1}


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


def fuzz(inputs: int, seed: int = 0, crashes_dir: Path | None = None,
         corpus: list[bytes] | None = None) -> FuzzResult:
    """Run ``inputs`` mutated checkpoints through ``load_checkpoint`` in this process."""
    from blutrain.train.checkpoint import CheckpointError, load_checkpoint

    corpus = corpus if corpus is not None else seed_corpus()
    rng = random.Random(seed)
    names = list(MUTATORS)
    weights = [_WEIGHTS[n] for n in names]
    result = FuzzResult()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None) as d:
        path = Path(d) / "input.safetensors"
        start = time.perf_counter()
        for _ in range(inputs):
            data = rng.choice(corpus)
            applied = rng.choices(names, weights, k=rng.choice([1, 1, 2, 3]))
            for name in applied:
                data = MUTATORS[name](rng, data, corpus)
            path.write_bytes(data)
            result.inputs += 1
            try:
                load_checkpoint(path)
                result.loaded += 1
            except CheckpointError as exc:
                if str(path) not in str(exc):
                    sig = "CheckpointError without the file name"
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


def _worker(args: tuple[int, int, str | None]) -> FuzzResult:
    inputs, seed, crashes = args
    return fuzz(inputs, seed, Path(crashes) if crashes else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crashes", type=Path, default=Path("fuzz_crashes"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.inputs <= 0 or args.workers <= 0:
        parser.error(f"--inputs and --workers must be positive, got {args.inputs} and {args.workers}")
    shares = [args.inputs // args.workers + (i < args.inputs % args.workers) for i in range(args.workers)]
    jobs = [(n, args.seed * 1000 + i, str(args.crashes)) for i, n in enumerate(shares) if n]
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


if __name__ == "__main__":
    sys.exit(main())
