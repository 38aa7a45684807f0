"""FP32 GEMM accuracy, issue 23's decision table: for every GEMM of a GPT-2 124M and 774M training step (each linear
layer's forward x Wᵀ, input gradient dy W and weight gradient dyᵀ x, and the LM head's in the chunks the cuda
backend runs it in), the error against a float64 product of the same operands of each way BluTrain can run a
float32 GEMM on cuda: cuBLAS SGEMM (strict float32, ``--fp32-gemm cublas``), BluTrain's 3xTF32 kernel
(``--fp32-gemm 3xtf32``), and cuBLAS TF32 (``--dtype tf32``, for scale).

    python tools/gemm_accuracy.py                        # on a GPU machine: the table, then the decision
    python tools/gemm_accuracy.py --presets gpt2-124m --out OUT/gemm_accuracy.json

Each product runs through ``blutrain.tensor.matmul`` on cuda tensors, the path a float32 training step's GEMMs
take, with the backend's setting switched between runs. Operands: standard normal activations and gradients,
weights N(0, 0.02²) (GPT-2's initialisation). Two errors per product C against the float64 product R:

- RMS relative: ||C − R||_F / ||R||_F;
- max relative: max over elements of |C − R| / (|op(A)| |op(B)|), the error against the scale of the terms
  summed into that element (the bound a float32 dot product's rounding error is measured against; the plain
  |C − R| / |R| is unbounded where terms cancel).

The decision rule (the issue's): 3xTF32 becomes the fp32 default only if it is no less accurate than SGEMM at
every shape on both errors; the last line says which, and the worst ratio. Prints the table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METHODS = ("sgemm", "3xtf32", "tf32")
# the LM head's rows per chunk on cuda: 256 MiB of float32 logits over a 50,304-token vocabulary
HEAD_CHUNK_ROWS = 1334
VOCAB = 50304
PRESETS = {  # name -> (n_embd, rows of one micro-batch: the benchmarks' B x T)
    "gpt2-124m": (768, 16 * 1024),
    "gpt2-774m": (1280, 8 * 1024),
}


@dataclass(frozen=True)
class Shape:
    """One GEMM of the step: C[M, N] = op(A) op(B) with K terms per element, ``layout`` as gemm_3xtf32 names it
    ("nt": x Wᵀ, "nn": dy W, "tn": dyᵀ x)."""

    preset: str
    label: str
    layout: str
    M: int
    N: int
    K: int


def shapes(preset: str) -> list[Shape]:
    """The GEMMs of one GPT-2 training step of ``preset``: four linears per block and the LM head."""
    if preset not in PRESETS:
        raise SystemExit(f"gemm_accuracy: --presets takes {', '.join(PRESETS)}, got {preset!r}")
    C, rows = PRESETS[preset]
    out: list[Shape] = []
    for name, n_in, n_out, r in (("attn qkv", C, 3 * C, rows), ("attn proj", C, C, rows), ("mlp fc", C, 4 * C, rows),
                                 ("mlp proj", 4 * C, C, rows), ("lm head chunk", C, VOCAB, HEAD_CHUNK_ROWS)):
        out += [Shape(preset, f"{name} fwd", "nt", r, n_out, n_in), Shape(preset, f"{name} dx", "nn", r, n_in, n_out),
                Shape(preset, f"{name} dW", "tn", n_out, n_in, r)]
    return out


def errors(xp: Any, got: Any, ref: Any, scale: Any) -> tuple[float, float]:
    """(RMS relative, max relative) of ``got`` against the float64 ``ref``; ``scale`` = |op(A)| |op(B)| in float64."""
    diff = xp.abs(got.astype(xp.float64) - ref)
    rms = float(xp.linalg.norm(diff) / xp.linalg.norm(ref))
    tiny = xp.finfo(xp.float64).tiny
    return rms, float(xp.max(diff / xp.maximum(scale, tiny)))


@dataclass
class Row:
    shape: Shape
    rms: dict[str, float] = field(default_factory=dict)
    max: dict[str, float] = field(default_factory=dict)

    def three_no_worse(self) -> bool:
        """3xTF32 no less accurate than SGEMM on both errors at this shape."""
        return self.rms["3xtf32"] <= self.rms["sgemm"] and self.max["3xtf32"] <= self.max["sgemm"]


def operands(xp: Any, s: Shape, seed: int) -> tuple[Any, Any]:
    """op(A) [M, K] and op(B) [K, N] as the step's tensors are laid out (a transposed view where the layout says)."""
    rng = xp.random.default_rng(seed)
    weight_std = 0.02
    if s.layout == "nt":  # x [M, K] times Wᵀ, W [N, K]
        a = rng.standard_normal((s.M, s.K), dtype=xp.float32)
        b = (rng.standard_normal((s.N, s.K), dtype=xp.float32) * weight_std).T
    elif s.layout == "nn":  # dy [M, K] times W [K, N]
        a = rng.standard_normal((s.M, s.K), dtype=xp.float32)
        b = rng.standard_normal((s.K, s.N), dtype=xp.float32) * weight_std
    else:  # "tn": dyᵀ x, dy [K, M], x [K, N]
        a = rng.standard_normal((s.K, s.M), dtype=xp.float32).T
        b = rng.standard_normal((s.K, s.N), dtype=xp.float32)
    return a, b


def measure(shape_list: list[Shape], seed: int) -> list[Row]:
    import cupy as cp

    import blutrain.tensor as bt
    from blutrain_backend_cupy import cuda

    rows = []
    for i, s in enumerate(shape_list):
        a, b = operands(cp, s, seed + i)
        ref = a.astype(cp.float64) @ b.astype(cp.float64)
        scale = cp.abs(a).astype(cp.float64) @ cp.abs(b).astype(cp.float64)
        dev = bt.device("cuda")
        # the step's tensors are contiguous; a transposed operand is the .t() view of one, as autograd's are
        ta, tb = (bt.Tensor.from_array(cp.ascontiguousarray(x.T), bt.float32, dev).t() if not x.flags.c_contiguous
                  else bt.Tensor.from_array(x, bt.float32, dev) for x in (a, b))
        row = Row(s)
        for method in METHODS:
            cuda.set_tf32(method == "tf32")
            cuda.set_fp32_gemm("3xtf32" if method == "3xtf32" else "cublas")
            got = bt.matmul(ta, tb).array
            row.rms[method], row.max[method] = errors(cp, got, ref, scale)
            del got
        cuda.set_tf32(False)
        cuda.set_fp32_gemm("cublas")
        del ref, scale, a, b
        cp.get_default_memory_pool().free_all_blocks()
        rows.append(row)
        print(f"  {s.preset} {s.label:<18} {s.M}x{s.N}x{s.K}: " +
              ", ".join(f"{m} {row.rms[m]:.2e}/{row.max[m]:.2e}" for m in METHODS), flush=True)
    return rows


def report(rows: list[Row]) -> str:
    lines = [f"{'preset':<10} {'GEMM':<19} {'M x N x K':>20}  " +
             "  ".join(f"{m + ' rms':>11} {m + ' max':>11}" for m in METHODS) + "  3xTF32<=SGEMM"]
    for r in rows:
        s = r.shape
        lines.append(f"{s.preset:<10} {s.label:<19} {f'{s.M}x{s.N}x{s.K}':>20}  " +
                     "  ".join(f"{r.rms[m]:11.2e} {r.max[m]:11.2e}" for m in METHODS) +
                     f"  {'yes' if r.three_no_worse() else 'NO'}")
    worst = max(max(r.rms["3xtf32"] / r.rms["sgemm"], r.max["3xtf32"] / r.max["sgemm"]) for r in rows)
    verdict = all(r.three_no_worse() for r in rows)
    lines.append(f"decision: 3xTF32 is {'no less' if verdict else 'less'} accurate than SGEMM at "
                 f"{'every' if verdict else 'some'} shape (worst 3xTF32/SGEMM error ratio {worst:.2f}): "
                 + ("it may become the fp32 default" if verdict else "it stays opt-in (--fp32-gemm 3xtf32)"))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="gpt2-124m,gpt2-774m", help=f"comma-separated of {', '.join(PRESETS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shape_list = [s for p in args.presets.split(",") if p for s in shapes(p)]
    rows = measure(shape_list, args.seed)
    text = report(rows)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([{"shape": asdict(r.shape), "rms": r.rms, "max": r.max} for r in rows],
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
