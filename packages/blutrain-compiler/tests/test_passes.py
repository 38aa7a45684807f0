"""The passes on small graphs: DCE, CSE, elementwise fusion, memory planning, kernel selection."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler import codegen_numpy
from blutrain.compiler.dialect import FusedOp
from blutrain.compiler.graph import body
from blutrain.compiler.passes.memory import Buffer, plan


def _names(module: object) -> list[str]:
    return [o.name for o in body(module).ops]  # type: ignore[arg-type]


def test_pass_registry_holds_the_builtin_passes() -> None:
    assert set(bc.default_pipeline()) <= set(bc.passes().names())
    assert {bc.passes().provider(name).plugin for name in bc.CORE_PIPELINE} == {"compiler-passes"}


def test_a_registered_place_puts_a_pass_before_the_first_run_of_a_core_pass() -> None:
    registry = bc.PassRegistry()
    registry.register("first", object(), runs_before="inplace-aliasing")
    registry.register("before-dce", object(), runs_before="dce")  # dce runs twice: placed before the first only
    registry.register("also-first", object(), runs_before="inplace-aliasing")
    registry.register("named-only", object())
    assert registry.pipeline() == ("copy-elision", "first", "also-first", "inplace-aliasing", "before-dce", "dce",
                                   *bc.CORE_PIPELINE[3:])
    assert registry.pipeline(["cse"]) == ("cse",)


def test_a_place_that_is_no_core_pass_is_refused_naming_it() -> None:
    with pytest.raises(bt.PluginError, match=r"compiler pass 'late': runs_before must name a pass of "
                                             r"blutrain.compiler.CORE_PIPELINE \(copy-elision, inplace-aliasing, dce, "
                                             r".*got 'fusion'"):
        bc.PassRegistry().register("late", object(), runs_before="fusion")


def test_each_device_brings_its_compile_target_and_an_unknown_device_is_named() -> None:
    from blutrain.compiler.target import compile_target, compile_targets

    targets = compile_targets()
    assert "cpu" in targets.names() and compile_target("cpu").device == "cpu"
    assert targets.provider("cpu").plugin == "compiler-passes"
    if "cuda" in targets.names():  # the CuPy backend plugin's, installed in this workspace
        assert targets.provider("cuda").plugin == "cuda" and compile_target("cuda").device == "cuda"
    with pytest.raises(bc.CompilerError, match=r"no compile target for device .tpu. .*installed: cpu"):
        compile_target("tpu")


def test_dce_removes_ops_whose_results_nothing_reads() -> None:
    module = bc.trace_module(lambda a: (a.exp(), a.log())[0], np.ones((3,), np.float32))
    bc.run_pipeline(module, ["dce"])
    assert "blutrain.log" not in _names(module)
    assert "blutrain.exp" in _names(module)


def test_cse_merges_identical_ops() -> None:
    module = bc.trace_module(lambda a: a.exp() + a.exp(), np.ones((3,), np.float32))
    bc.run_pipeline(module, ["cse", "dce"])
    assert _names(module).count("blutrain.exp") == 1


def test_elementwise_chain_with_a_broadcast_becomes_one_fused_kernel() -> None:
    a = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((5,)).astype(np.float32)

    def f(x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
        return ((x + y).tanh() * 0.5 - 1.0).exp()

    module = bc.trace_module(f, a, b)
    bc.run_pipeline(module, ["elementwise-fusion"])
    ops = list(body(module).ops)
    fused = [o for o in ops if isinstance(o, FusedOp)]
    assert len(fused) == 1 and len(ops) == 2  # the fused op and the return
    src = codegen_numpy.source(fused[0])
    assert src.count("out=") == 4  # one allocation for five ops
    (got,) = codegen_numpy.compile_region(fused[0])(codegen_numpy.region_consts(
        codegen_numpy.member_templates(fused[0])), a, b)
    np.testing.assert_array_equal(got, f(bt.from_numpy(a), bt.from_numpy(b)).numpy())


def test_fusion_keeps_intermediates_read_outside_the_region() -> None:
    module = bc.trace_module(lambda x: ((x * 2.0).exp(), (x * 2.0).exp().sum()), np.ones((3,), np.float32))
    bc.run_pipeline(module, ["cse", "dce", "elementwise-fusion"])
    (fused,) = [o for o in body(module).ops if isinstance(o, FusedOp)]
    assert len(fused.results) == 1 and fused.results[0].uses


def test_memory_plan_reuses_memory_of_dead_buffers() -> None:
    bufs = [Buffer(None, 1024, 0, 1), Buffer(None, 1024, 1, 2), Buffer(None, 1024, 2, 3),  # type: ignore[arg-type]
            Buffer(None, 512, 3, 4)]  # type: ignore[arg-type]
    arena = plan(bufs)
    assert arena == 2048  # a chain needs two buffers at a time
    for x in bufs:
        for y in bufs:
            if x is not y and x.start <= y.end and y.start <= x.end:
                assert x.offset + x.size <= y.offset or y.offset + y.size <= x.offset


def test_memory_plan_reports_peak_below_the_sum_of_buffers() -> None:
    module = bc.trace_module(lambda x: x.exp().log().sum(), np.ones((64, 64), np.float32))
    bc.run_pipeline(module, ["memory-plan"])
    arena = module.attributes["blutrain.arena_bytes"].data  # type: ignore[attr-defined]
    total = module.attributes["blutrain.buffer_bytes"].data  # type: ignore[attr-defined]
    assert arena == 2 * 64 * 64 * 4 and total == 2 * 64 * 64 * 4 + 256


def test_kernel_selection_names_the_provider() -> None:
    module = bc.trace_module(lambda x: x @ x, np.ones((4, 4), np.float32))
    bc.run_pipeline(module, ["kernel-selection"])
    assert 'kernel = "cpu-kernels"' in str(module)
