"""Mutation fuzzer of the checkpoint reader, ``blutrain.train.load_checkpoint``.

The reader's contract: any file either loads or raises ``blutrain.train.CheckpointError`` naming the
file and what is wrong. Anything else it raises (``KeyError``, ``TypeError``, ``RecursionError``,
``MemoryError``, a NumPy error, ...) is a crash, i.e. a bug.

Inputs start from a seed corpus of valid checkpoints (every dtype, 0-d and empty tensors, nested
optimizer state) written by ``save_checkpoint``, and get one to three stacked mutations:

- bytes and header, the safetensors mutators of tools/fuzz_safetensors.py: truncation, bit flips, bytes
  set to boundary values, chunks deleted, duplicated or inserted, the 8-byte header length changed, two
  corpus files spliced; the JSON re-encoded after a structural change of one entry (dtype, shape,
  data_offsets set to wrong values or types, keys removed or added, entries dropped, duplicated or
  swapped), the whole header replaced by a non-object or by bytes that are not UTF-8, the length prefix
  left stale;
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

import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import fuzz_safetensors as st  # tools/ is on the path: a script's own folder, and the tests' pythonpath
import numpy as np


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


# ------------------------------------------------------------------------------------------ digests
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


def _fix_digests_half_the_time(rng: random.Random, header: dict[str, Any], body: bytes) -> None:
    """The header mutators' hook: half the inputs keep stale digests (the checksum check is fuzzed), the
    other half reach the checks behind it."""
    if rng.random() < 0.5:
        _fix_digests(header, body)


# ------------------------------------------------------------------------------------------ metadata mutator
def _metadata_text(rng: random.Random, header: dict[str, Any]) -> str:
    names = st.tensor_names(header)
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
    parts = st.split_header(data)
    if parts is None:
        return st.bit_flips(rng, data, corpus)
    header, body = parts
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        header["__metadata__"] = rng.choice(st.ODD_VALUES)
        return st.join_header(header, body)
    key = rng.choice(["format", "optimizer", "trainer", "loader", "rng", "config", "sha256", "metadata_sha256",
                      "extra"])
    kind = rng.randrange(4)
    if kind == 0:
        meta.pop(key, None)
    elif kind == 1:
        meta[key] = rng.choice(st.ODD_VALUES)
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
    return st.join_header(header, body)


# the safetensors mutators, their header edits followed by the digests' fix, and the checkpoint's own
MUTATORS = {**st.mutators(fix=_fix_digests_half_the_time), "metadata_edit": metadata_edit}
# structure-aware mutators are picked more often: they reach past the header checks
WEIGHTS = {"truncate": 1, "bit_flips": 2, "set_bytes": 1, "chunk_edit": 1, "header_length": 1, "splice": 1,
           "entry_field": 4, "entries_edit": 2, "metadata_edit": 4, "raw_header": 1}


# ------------------------------------------------------------------------------------------ driver
def fuzz(inputs: int, seed: int = 0, crashes_dir: Path | None = None,
         corpus: list[bytes] | None = None) -> st.FuzzResult:
    """Run ``inputs`` mutated checkpoints through ``load_checkpoint`` in this process."""
    from blutrain.train.checkpoint import CheckpointError, load_checkpoint

    return st.fuzz_reader(load_checkpoint, CheckpointError, corpus if corpus is not None else seed_corpus(),
                          MUTATORS, WEIGHTS, inputs, seed, crashes_dir)


def main(argv: list[str] | None = None) -> int:
    return st.cli(fuzz, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
