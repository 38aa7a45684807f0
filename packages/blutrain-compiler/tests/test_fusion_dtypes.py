"""Elementwise fusion across dtypes: casts and float16/bfloat16 ops fuse with float32/float64 ones of the
same iteration shape, and a fused region gives the bits the unfused ops give (on the CPU here; the same
checks on CUDA are in test_fusion_cuda.py)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import ModuleOp

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler import codegen_cuda, codegen_numpy
from blutrain.compiler.dialect import FusedOp, is_kernel, kernel_name
from blutrain.compiler.graph import body, build_module
from blutrain.compiler.passes.fusion import ELEMENTWISE, fusible
from blutrain.compiler.trace import Tracer, tracing

# the eager kernels warn on the special values (inf - inf, overflow to inf in a cast): results, not errors
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BF16 = np.dtype(ml_dtypes.bfloat16)


def _fused(fn: Any, *arrays: np.ndarray[Any, Any]) -> ModuleOp:
    """The module of ``fn`` traced on ``arrays`` after elementwise fusion."""
    module = bc.trace_module(fn, *arrays)
    bc.run_pipeline(module, ["elementwise-fusion"])
    return module


def _regions(module: ModuleOp) -> list[list[str]]:
    """The kernel names of each fused region's members, in order."""
    return [[kernel_name(m) for m in o.body.block.ops if is_kernel(m)]
            for o in body(module).ops if isinstance(o, FusedOp)]


def _outside(module: ModuleOp) -> list[str]:
    """The kernels left outside fused regions."""
    return [kernel_name(o) for o in body(module).ops if is_kernel(o)]


def _run_region(region: FusedOp, *arrays: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    consts = codegen_numpy.region_consts(codegen_numpy.member_templates(region))
    return tuple(codegen_numpy.compile_region(region)(consts, *arrays))




def _bf16(shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16)


# -- the pass ------------------------------------------------------------------------------------------------

def test_a_chain_of_casts_is_one_region() -> None:
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    module = _fused(lambda t: t.bfloat16().float().half().double(), x)
    assert _regions(module) == [["cast", "cast", "cast", "cast"]]
    assert _outside(module) == []


def test_a_bfloat16_add_and_its_cast_are_one_region() -> None:
    module = _fused(lambda a, b: (a + b).float(), _bf16((4, 5), 0), _bf16((4, 5), 1))
    assert _regions(module) == [["add", "cast"]]


def test_cast_add_cast_across_dtypes_is_one_kernel() -> None:
    """``cast(bf16 → f32)``, ``add(f32, f32)`` (a broadcast input), ``cast(f32 → bf16)``: one region whose
    inputs keep their dtypes and whose result is bfloat16."""
    b = np.random.default_rng(1).standard_normal((5,)).astype(np.float32)
    module = _fused(lambda a, b: (a.float() + b).bfloat16(), _bf16((4, 5), 0), b)
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    assert _regions(module) == [["cast", "add", "cast"]]
    assert [str(v.type) for v in region.operands] == ["tensor<4x5xbf16>", "tensor<5xf32>"]
    assert [str(v.type) for v in region.results] == ["tensor<4x5xbf16>"]


def test_ops_of_another_result_shape_are_not_fused() -> None:
    """A chain over the (5,) bias and the (4, 5) op that broadcasts it have different iteration shapes."""
    a = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    module = _fused(lambda a, b: a + (b.float() * 2.0), a, _bf16((5,), 1))
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    assert _regions(module) == [["cast", "mul"]]
    assert str(region.results[0].type) == "tensor<5xf32>"
    assert _outside(module) == ["add"]


def test_a_region_does_not_grow_past_a_write() -> None:
    """The fused op runs at its last member's place: a member after an in-place write would move before it."""
    def f(x: bt.Tensor, c: bt.Tensor) -> bt.Tensor:
        w = x.float() + 1.0
        c.add_(1.0)  # writes memory between ``w`` and ``w * 3``
        return w * 3.0

    module = _fused(f, _bf16((4, 5), 0), np.zeros((3,), np.float32))
    assert _regions(module) == [["cast", "add"]]
    assert _outside(module) == ["add", "mul"]  # the write's add and the op after the write


def test_an_op_joins_the_regions_of_all_its_operands() -> None:
    module = _fused(lambda a, b: (a.float() + b.float()).exp(), _bf16((4, 5), 0), _bf16((4, 5), 1))
    assert _regions(module) == [["cast", "cast", "add", "exp"]]


def test_ops_whose_scalars_change_between_calls_are_not_fused() -> None:
    tracer = Tracer()
    with tracing(tracer):
        t = bt.from_numpy(_bf16((4, 5), 0))
        with bt.capture.substitute_arrays([t], [tracer.add_input(t.array)]):
            out = (t * 0.5).float()
    mul_uid = next(ev.uid for ev in tracer.events if ev.op == "mul")
    module = build_module(tracer, [out.array.vid], dynamic=frozenset({mul_uid}))
    bc.run_pipeline(module, ["elementwise-fusion"])
    assert _regions(module) == []


def test_a_half_op_whose_eager_result_was_not_rounded_is_not_fusible() -> None:
    """On the CPU a 0-d float16/bfloat16 op comes back as its float32 result (NumPy returns a scalar, which the
    half-precision wrapper does not round): its result dtype is not the op's, and fusing it would round."""
    module = _fused(lambda a: (a + a) * 2.0, np.array(1.5, BF16))
    kernels = [o for o in body(module).ops if is_kernel(o)]
    assert kernels and not any(fusible(o) for o in kernels if o.properties["dtype"].data == "bfloat16"
                               and str(o.results[0].type).endswith("f32>"))
    assert _regions(module) == []


# -- CPU codegen: the eager bits -----------------------------------------------------------------------------

_SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 3.3895e38, 65504.0, 7e4,
                     1.00390625, 1.01171875, 6e-8], np.float64)


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """Random normal values with the special ones (zeros, infinities, NaN, subnormals, overflow to inf in
    float16 and bfloat16, values halfway between two bfloat16) at the front."""
    v = np.random.default_rng(seed).standard_normal(shape) * 4.0
    flat = v.reshape(-1)
    n = min(flat.size, _SPECIAL.size)
    flat[:n] = _SPECIAL[np.random.default_rng(seed + 1).permutation(_SPECIAL.size)[:n]]
    return v


_ARGS: dict[str, list[tuple[Any, ...]]] = {
    "add": [(1.25,)], "sub": [(0.75,)], "mul": [(3.0,)], "div": [(7.0,)],
    "pow": [(2,), (0.5,), (-1.0,), (3.0,), (1.0,), (0.0,)],  # NumPy's ``**`` fast paths and others
    "maximum": [(0.5,)], "minimum": [(-0.5,)]}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_each_elementwise_op_in_each_float_dtype_gives_the_eager_bits(dtype: str, same_bits: Any) -> None:
    """``x.to(dtype)``, each op with a tensor and with scalars, ``.double()``: every member's result rounded to
    its dtype as its eager kernel rounds it."""
    x = _values((6, 7), 0).astype(np.float32)
    y = _values((7,), 5).astype(np.float32)  # broadcast along the rows

    def f(x: bt.Tensor, y: bt.Tensor) -> tuple[bt.Tensor, ...]:
        a, b = x.to(dtype), y.to(dtype)
        outs = []
        for name in sorted(ELEMENTWISE):
            method = getattr(a, name)
            if name in _ARGS:
                outs += [method(b).double(), *(method(*scalars).double() for scalars in _ARGS[name])]
            else:
                outs.append(method().double())
        outs += [(1.5**a).double(), (1.5 - a).double(), (2.0 / a).double()]  # a scalar first
        return tuple(outs)

    fn = bc.compile(f, warmup=0)
    xt, yt = bt.from_numpy(x), bt.from_numpy(y)
    fn(xt, yt)
    got = fn(xt, yt)  # the replay runs the fused regions
    assert _outside(bc.parse(fn.ir())) in ([], ["cast"])  # every op is in a region but y's cast (another shape)
    for g, e in zip(got, f(xt, yt), strict=True):
        same_bits(g.numpy(), e.numpy())


def _mixed(x: bt.Tensor, y: bt.Tensor, z: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor, bt.Tensor]:
    """bfloat16, float16, float32 and float64 ops and casts between them, all of one iteration shape (y and z
    broadcast)."""
    a = x.float() * y + 1.5  # cast, float32 mul (y broadcast), float32 add
    b = a.bfloat16()
    c = (b * x - 0.25).exp() / (z.abs() + 1.0)  # bfloat16 ops; z: a bfloat16 (1, n) input
    d = c.half().maximum(x.half()).sqrt()  # float16 ops
    e = d.double().log() - a.double().tanh()  # float64 ops
    return c.float() + a, d, e


_SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@settings(max_examples=25, deadline=None)
@given(shape=_SHAPES, seed=st.integers(0, 2**16))
def test_a_compiled_mix_of_half_float32_and_casts_gives_the_eager_bits(shape: tuple[int, ...], seed: int,
                                                                        same_bits: Any) -> None:
    x = _values(shape, seed).astype(BF16)
    y = _values(shape[-1:], seed + 7).astype(np.float32)
    z = _values((1, shape[-1]), seed + 9).astype(BF16)
    fn = bc.compile(_mixed, warmup=0)
    args = [bt.from_numpy(v) for v in (x, y, z)]
    fn(*args)
    got = fn(*args)  # replayed: fused regions
    assert fn.stats.fused_regions >= 1
    for g, e in zip(got, _mixed(*args), strict=True):
        same_bits(g.numpy(), e.numpy())


def test_the_mix_fuses_into_regions_that_hold_every_dtype() -> None:
    shape = (4, 6)
    module = _fused(_mixed, _values(shape, 0).astype(BF16), _values((6,), 1).astype(np.float32),
                    _values((1, 6), 2).astype(BF16))
    regions = [o for o in body(module).ops if isinstance(o, FusedOp)]
    dtypes = {m.properties["dtype"].data for o in regions for m in o.body.block.ops if is_kernel(m)}
    assert dtypes == {"bfloat16", "float16", "float32", "float64"}
    assert sorted(len(r) for r in _regions(module)) == [2, 19]  # z's (1, 6) ops: another iteration shape
    assert _outside(module) == []


def test_the_numpy_code_of_a_half_member_widens_computes_in_float32_and_rounds_once(same_bits: Any) -> None:
    module = _fused(lambda a, b: (a + b).exp(), _bf16((4, 5), 0), _bf16((4, 5), 1))
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    src = codegen_numpy.source(region)
    assert src.count(".astype(DT['float32'])") == 3  # the two inputs and the add's rounded result
    assert src.count(".astype(DT['bfloat16'])") == 2  # each member's result, once
    assert "out=" in src  # the float32 temporaries are reused
    (got,) = _run_region(region, _bf16((4, 5), 0), _bf16((4, 5), 1))
    expected = (bt.from_numpy(_bf16((4, 5), 0)) + bt.from_numpy(_bf16((4, 5), 1))).exp().numpy()
    same_bits(got, expected)


def test_a_float32_chain_still_allocates_one_array() -> None:
    module = _fused(lambda a: (a.float() * 2.0 + 1.0).tanh().exp(), _bf16((4, 5), 0))
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    src = codegen_numpy.source(region)
    assert src.count("out=") == 4  # the cast's result is the only new array


# -- CUDA codegen's source (compiled and run on a GPU in test_fusion_cuda.py) -------------------------------

def test_cuda_source_passes_half_arrays_as_uint16_and_rounds_each_half_member() -> None:
    b = np.random.default_rng(1).standard_normal((5,)).astype(np.float32)
    module = _fused(lambda a, b: ((a.float() + b).bfloat16() * 0.5).half(), _bf16((4, 5), 0), b)
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    ins, outs, operation, _ = codegen_cuda.kernel_source(region)
    assert ins == "float32 c0, uint16 in0, float32 in1"
    assert outs == "uint16 out0"
    assert operation.splitlines() == [
        "float v0 = bt_bf16_to_f32(in0);",
        "float v1 = __fadd_rn(v0, in1);",
        "unsigned short v2 = bt_f32_to_bf16(v1);",
        "unsigned short v3 = bt_f32_to_bf16(__fmul_rn(bt_bf16_to_f32(v2), c0));",
        "unsigned short v4 = bt_bf16_to_f16(v3);",
        "out0 = v4;",
    ]
    for fn in ("bt_bf16_to_f32", "bt_f32_to_bf16", "bt_bf16_to_f16"):
        assert f" {fn}(" in codegen_cuda.PREAMBLE


def test_cuda_source_computes_float64_members_in_double() -> None:
    module = _fused(lambda a: (a.double() * 2.0).sqrt().float(), np.ones((3,), np.float32))
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    ins, outs, operation, _ = codegen_cuda.kernel_source(region)
    assert ins == "float64 c0, float32 in0" and outs == "float32 out0"
    assert "double v1 = __dmul_rn(v0, c0);" in operation and "double v2 = sqrt(v1);" in operation


def test_cuda_source_gives_a_scalar_exponent_the_fast_path_chosen_per_call() -> None:
    module = _fused(lambda a: (a.float() ** 2.0).bfloat16(), _bf16((4, 5), 0))
    ((region),) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    ins, _, operation, _ = codegen_cuda.kernel_source(region)
    assert ins == "float32 c0, int32 p0, uint16 in0"
    assert "bt_pow_scalar(v0, c0, p0)" in operation
    assert [codegen_cuda.pow_fast_path(e) for e in (2, 2.0, 0.5, -1.0, -1, 3.0, 1.0, np.float64(0.5))] == \
        [1, 1, 2, 3, 0, 0, 0, 2]
