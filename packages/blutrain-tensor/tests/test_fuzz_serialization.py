"""``load_file`` under a mutation fuzzer, at CI size: every mutated file loads or raises
``SerializationError`` naming the file; nothing else escapes (no KeyError, TypeError, IndexError,
RecursionError, NumPy error, ...).

Inputs start from valid files written by ``save_file`` (every dtype, 0-d and empty tensors, metadata)
and get one to three stacked mutations: byte-level ones (truncation, bit flips, boundary bytes, chunks
deleted, duplicated or inserted, the length prefix changed, two files spliced) and structure-aware ones
that re-encode the JSON header after changing one entry (dtype, shape, data_offsets given wrong values
or types, keys removed or added, entries dropped, duplicated or swapped, metadata made non-strings) or
replace it by JSON the reader must refuse (deep nesting, numbers with too many digits, duplicate keys,
bytes that are not UTF-8).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import blutrain.tensor as bt
from blutrain.tensor import SerializationError, load_file, save_file

Mutator = Callable[[random.Random, bytes, list[bytes]], bytes]

_CODES = ["BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"]
_ODD: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 2**100, -(2**63), 1.5, float("nan"),
                   float("inf"), "", "x", "F32", [], [0], [-1], [1, 2, 3], [0, 2**64], {}, {"a": 1}, [[1]],
                   "0" * 40, [None, None], [1.0, 2.0], [True, False]]
_RAW_HEADERS = [b"\xff\xfe\x00", b"{\"a\":\xc3\x28}", b"[1,2", b"{}", b"[]", b"3", b"null", b"NaN",
                b"{\"__metadata__\": 5}", b"{\"__metadata__\": {\"k\": 1}}", b"{\"w\": 5}",
                b"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, \"w\": {}}",
                b"{\"w\": {\"dtype\": \"F32\", \"shape\": [" + b"9" * 5000 + b"], \"data_offsets\": [0, 4]}}",
                b"[" * 100_000, b"{\"a\":" * 5000 + b"1" + b"}" * 5000, b"{" * 5000, b"\"\\ud800\"",
                b"{\"w\": {\"dtype\": \"F32\", \"shape\": [" + b",".join([b"1"] * 200)
                + b"], \"data_offsets\": [0, 4]}}"]


def _corpus(tmp: Path) -> list[bytes]:
    rng = np.random.default_rng(0)
    cases: list[tuple[dict[str, bt.Tensor], dict[str, str] | None]] = [
        ({"w": bt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)),
          "b": bt.from_numpy(rng.standard_normal(4).astype(np.float32))}, {"format": "pt"}),
        ({d.name: bt.arange(6).reshape(2, 3).to(dtype=d) for d in bt.ALL_DTYPES}, None),
        ({"scalar": bt.tensor(3.5), "empty": bt.zeros((0, 3)), "e2": bt.zeros((2, 0), dtype="int64"),
          "mask": bt.from_numpy(np.array([True, False, True]))}, {"a": "1", "b": "x"}),
        ({}, None),
    ]
    out = []
    for i, (tensors, meta) in enumerate(cases):
        path = tmp / f"seed{i}.safetensors"
        save_file(tensors, path, metadata=meta)
        out.append(path.read_bytes())
    return out


def _split(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return (header, data[8 + n:]) if isinstance(header, dict) else None


def _join(header: Any, body: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + body


def _truncate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    return data[:rng.randrange(len(data) + 1)]


def _bit_flips(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 2, 4]) if buf else 0):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _set_bytes(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4) if buf else 0):
        buf[rng.randrange(len(buf))] = rng.choice([0, 1, 2, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("9")])
    return bytes(buf)


def _chunk_edit(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
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


def _header_length(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    n = int.from_bytes(data[:8].ljust(8, b"\0"), "little")
    new = rng.choice([0, 1, 7, n - 1, n + 1, n + 8, len(data), len(data) - 8, 2**63, 2**64 - 1])
    return int(new % 2**64).to_bytes(8, "little") + data[8:]


def _splice(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    other = rng.choice(corpus)
    return data[:rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]


def _entry_field(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    parts = _split(data)
    names = [k for k in parts[0] if k != "__metadata__"] if parts else []
    if parts is None or not names:
        return _bit_flips(rng, data, corpus)
    header, body = parts
    name = rng.choice(names)
    info = header[name]
    if not isinstance(info, dict):
        header[name] = rng.choice(_ODD)
        return _join(header, body)
    key = rng.choice(["dtype", "shape", "data_offsets"])
    kind = rng.randrange(5)
    if kind == 0:
        info.pop(key, None)
    elif kind == 1:
        info[key] = rng.choice(_ODD)
    elif key == "dtype":
        info[key] = rng.choice([*_CODES, "F8", "f32", "float32", "C64"])
    elif key == "shape" and isinstance(info.get("shape"), list):
        shape = list(info["shape"])
        if shape and rng.random() < 0.5:
            shape[rng.randrange(len(shape))] = rng.choice([-1, 0, 1, 2**31, 2**62, 2**64, 3.0, True, "2"])
        else:
            shape = rng.choice([[], [0, 2**62, 2**62], [2**40, 2**40], [1] * 40, [rng.randrange(100)], shape[::-1]])
        info[key] = shape
    elif key == "data_offsets" and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2 \
            and all(type(o) is int for o in info["data_offsets"]):
        a, b = info["data_offsets"]
        d = rng.choice([-4, -1, 1, 4, 2**40, 2**64])
        info[key] = rng.choice([[b, a], [a + d, b], [a, b + d], [0, b - a], [a, b, 0], [a], [str(a), b]])
    else:
        info["extra"] = 1
    return _join(header, body)


def _entries_edit(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    parts = _split(data)
    if parts is None:
        return _chunk_edit(rng, data, corpus)
    header, body = parts
    names = [k for k in header if k != "__metadata__"]
    kind = rng.randrange(6)
    if kind == 0 and names:
        del header[rng.choice(names)]
    elif kind == 1 and names:
        header[f"{rng.choice(names)}.copy"] = header[rng.choice(names)]
    elif kind == 2 and len(names) >= 2:
        a, b = rng.sample(names, 2)
        header[a], header[b] = header[b], header[a]
    elif kind == 3:
        header["__metadata__"] = rng.choice([*_ODD, {"k": rng.choice(_ODD)}])
    elif kind == 4:
        return _join(rng.choice([[], 3, "header", None, [header]]), body)
    else:
        body += bytes(rng.randint(1, 16))
    return _join(header, body)


def _raw_header(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    head = rng.choice([*_RAW_HEADERS, bytes(rng.randrange(256) for _ in range(24))])
    body = data[8 + int.from_bytes(data[:8].ljust(8, b"\0"), "little"):] if len(data) >= 8 else b""
    return len(head).to_bytes(8, "little") + head + body


# structure-aware mutators are picked more often: they reach past the length and JSON checks
MUTATORS: dict[Mutator, int] = {_truncate: 1, _bit_flips: 2, _set_bytes: 1, _chunk_edit: 1, _header_length: 1,
                                _splice: 1, _entry_field: 5, _entries_edit: 3, _raw_header: 2}


def test_load_file_loads_or_raises_serialization_error_naming_the_file(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    rng = random.Random(20240521)
    mutators, weights = list(MUTATORS), list(MUTATORS.values())
    path = tmp_path / "input.safetensors"
    loaded = rejected = 0
    crashes: dict[str, str] = {}
    for _ in range(4000):
        data = rng.choice(corpus)
        for mutate in rng.choices(mutators, weights, k=rng.choice([1, 1, 2, 3])):
            data = mutate(rng, data, corpus)
        path.write_bytes(data)
        try:
            load_file(path)
            loaded += 1
        except SerializationError as exc:
            rejected += 1
            if str(path) not in str(exc):
                crashes.setdefault("SerializationError without the file name", str(exc)[:200])
        except Exception as exc:  # the contract allows nothing else: every other type is a crash
            crashes.setdefault(type(exc).__name__, f"{exc!s:.200} on header {data[:120]!r}")
    assert crashes == {}
    assert loaded > 100 and rejected > 1000  # both outcomes were reached, often


def test_every_seed_of_the_fuzzer_loads(tmp_path: Path) -> None:
    for i, data in enumerate(_corpus(tmp_path)):
        path = tmp_path / f"copy{i}.safetensors"
        path.write_bytes(data)
        assert set(load_file(path)) == set(load_file(tmp_path / f"seed{i}.safetensors"))
