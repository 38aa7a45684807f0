"""tools/gemm_accuracy.py's host side on NumPy: the GEMMs of a GPT-2 step (shapes and layouts), the two errors
against a float64 product, and the decision line (the GPU run is the tool's own; nothing here times anything)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gemm_accuracy as ga


def test_every_linear_of_a_gpt2_step_and_the_chunked_head_is_a_forward_dx_and_dw_gemm() -> None:
    got = ga.shapes("gpt2-124m")
    assert len(got) == 15 and {s.layout for s in got} == {"nt", "nn", "tn"}
    fc = {s.label: (s.M, s.N, s.K) for s in got}
    assert fc["mlp fc fwd"] == (16384, 3072, 768) and fc["mlp fc dx"] == (16384, 768, 3072)
    assert fc["mlp fc dW"] == (3072, 768, 16384) and fc["lm head chunk fwd"] == (1334, 50304, 768)
    assert {s.M for s in ga.shapes("gpt2-774m") if s.label.endswith("fwd") and "head" not in s.label} == {8192}
    with pytest.raises(SystemExit, match="--presets takes gpt2-124m, gpt2-774m, got 'gpt2-xl'"):
        ga.shapes("gpt2-xl")


@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
def test_operands_have_the_layouts_shapes_and_the_errors_vanish_for_an_exact_product(layout: str) -> None:
    s = ga.Shape("gpt2-124m", "x", layout, 6, 5, 7)
    a, b = ga.operands(np, s, 0)
    assert a.shape == (6, 7) and b.shape == (7, 5) and a.dtype == b.dtype == np.float32
    assert a.flags.c_contiguous == (layout != "tn") and b.flags.c_contiguous == (layout != "nt")
    ref = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert ga.errors(np, ref, ref, scale) == (0.0, 0.0)
    rms, most = ga.errors(np, (a @ b).astype(np.float32), ref, scale)
    assert 0 <= rms < 1e-5 and 0 <= most < 1e-5  # a float32 product of 7 terms: a few ulps


def test_the_decision_needs_3xtf32_no_worse_at_every_shape_on_both_errors() -> None:
    def row(rms3: float, max3: float) -> ga.Row:
        return ga.Row(ga.Shape("gpt2-124m", "g", "nt", 1, 1, 1), {"sgemm": 1e-7, "3xtf32": rms3, "tf32": 1e-4},
                      {"sgemm": 1e-6, "3xtf32": max3, "tf32": 1e-3})

    assert "may become the fp32 default" in ga.report([row(1e-7, 1e-6), row(5e-8, 5e-7)]).splitlines()[-1]
    last = ga.report([row(1e-7, 1e-6), row(5e-8, 2e-6)]).splitlines()[-1]
    assert "stays opt-in" in last and "worst 3xTF32/SGEMM error ratio 2.00" in last
