"""The layernorm-cast pass: autocast's cast of a LayerNorm output for the next GEMM folded into the LayerNorm,
which writes its output in the GEMM's dtype; the compiled results against eager."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.graph import body


def _norm_then_gemm(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor, m: bt.Tensor) -> bt.Tensor:
    with bt.autocast(dtype="bfloat16"):
        return bt.linear(bt.layer_norm(x, x.shape[-1], w, b), m)


def _ops(fn: Any, *arrays: np.ndarray) -> list[Any]:
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, ["layernorm-cast"])
    return list(body(module).ops)


def _arrays(seed: int, rows: int = 6, cols: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, cols)).astype(np.float32), rng.standard_normal(cols).astype(np.float32),
            rng.standard_normal(cols).astype(np.float32), rng.standard_normal((cols, cols)).astype(np.float32)]


def test_the_layernorm_writes_the_gemms_dtype_and_its_cast_is_gone() -> None:
    ops = _ops(_norm_then_gemm, *_arrays(0))
    norm = next(o for o in ops if o.name == "blutrain.layer_norm")
    assert "bf16" in str(norm.results[0].type)
    casts = [o for o in ops if o.name == "blutrain.cast"]
    assert len(casts) == 1 and norm.results[0] not in casts[0].operands  # only the weight's cast is left


def test_no_fold_where_the_output_has_another_reader() -> None:
    def twice(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor, m: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        y = bt.layer_norm(x, x.shape[-1], w, b)
        with bt.autocast(dtype="bfloat16"):
            return bt.linear(y, m), y

    norm = next(o for o in _ops(twice, *_arrays(1)) if o.name == "blutrain.layer_norm")
    assert "f32" in str(norm.results[0].type)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.booleans(), st.integers(0, 2**16))
def test_compiled_autocast_layernorm_trains_as_eager_bit_for_bit(sgd_eager_and_compiled: Any, same_bits: Any,
                                                                  rows: int, cols: int, affine: bool,
                                                                  seed: int) -> None:
    """LayerNorm's float32 result rounded once to bf16, as the cast did: four SGD steps of a LayerNorm and a
    projection under autocast are eager's bit for bit on the CPU."""
    rng = np.random.default_rng(seed)
    x, m, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((rows, cols), (cols, cols), cols, cols))

    def loss(xt: bt.Tensor, m: bt.Tensor, w: Any, b: Any) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):  # no residual add: gemm-epilogue would round it once less
            y = bt.linear(bt.layer_norm(xt, cols, w, b), m)
        return (y.float() * y.float()).sum()

    eager, compiled, ir = sgd_eager_and_compiled(loss, [m, w if affine else None, b if affine else None], x)
    assert '{np_dtype = "bfloat16"}], ret = [' in ir  # the layer_norm call names its output dtype
    for a, c in zip(eager, compiled, strict=True):
        same_bits(c, a)


@pytest.mark.cuda
def test_on_cuda_the_bf16_layernorm_output_matches_eager_bit_for_bit() -> None:
    """The kernel rounds each float32 result to bf16 once, as the cast kernel did."""
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")
    x, w, b, _ = (bt.from_numpy(a).to("cuda") for a in _arrays(4, 512, 768))

    def norm(x: bt.Tensor, w: bt.Tensor, b: bt.Tensor) -> bt.Tensor:
        with bt.autocast(dtype="bfloat16"):
            return bt.layer_norm(x, x.shape[-1], w, b).to(dtype="bfloat16")

    fn = bc.compile(norm)
    got = [fn(x, w, b).float().cpu().numpy() for _ in range(3)]
    want = norm(x, w, b).float().cpu().numpy()
    assert '{np_dtype = "bfloat16"}], ret = [' in fn.ir()
    for g in got:
        np.testing.assert_array_equal(g, want)
