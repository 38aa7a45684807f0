"""What can be checked of the CUDA kernels without a GPU: the sources, their header, the registry
the device plugin reads, and the Philox reference against Random123's known answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from blutrain.kernels import cuda
from blutrain.kernels.cuda import _casts, _gemm_3xtf32, _half_elementwise
from blutrain.kernels.cuda import philox_reference as ref

CUDA_DIR = Path(cuda.__file__).parent


@pytest.mark.parametrize("family", cuda.FAMILIES)
def test_every_family_has_a_source_that_opens_with_its_description(family: str) -> None:
    text = (CUDA_DIR / f"{family}.cu").read_text()
    first = text.lstrip().splitlines()[0]
    assert first.startswith("//") and len(first) > 20
    head = text.split("#include")[0] if "#include" in text else text[:3000]
    assert re.search(r"[Bb]ytes", head), "the opening comment should count bytes and FLOPs"


@pytest.mark.parametrize("family", cuda.FAMILIES)
def test_source_pastes_the_common_header_and_exports_c_kernels(family: str) -> None:
    code = cuda.source(family)
    assert '#include "common.cuh"' not in code
    assert "#include <" not in code  # NVRTC has no host headers
    assert 'extern "C" __global__' in code


def test_unknown_family_is_an_error_listing_the_families() -> None:
    with pytest.raises(KeyError, match="families: adamw"):
        cuda.source("nope")


def test_registry_names_ops_and_dtypes_the_plugin_can_register() -> None:
    for op, (fn, dtypes) in {**cuda.KERNELS, **cuda.STANDALONE}.items():
        assert callable(fn) and dtypes and set(dtypes) <= {"float32", "bfloat16", "float16"}, op


def test_every_cast_the_launcher_names_is_a_kernel_of_casts_cu() -> None:
    code = cuda.source("casts")
    pairs = set(re.findall(r"^CAST_KERNELS\((\w+), (\w+), (\w+)\)$", code, re.M))
    defined = {f"cast_{name}_{v}" for name, _, _ in pairs for v in ("v8", "v1")}
    named = {kernel for names in _casts._CASTS.values() for kernel in names}
    assert len(_casts._CASTS) == 6 and named == defined


def test_every_pair_of_the_cast_kernels_has_a_multi_tensor_kernel_of_the_same_tile() -> None:
    code = cuda.source("casts")
    pairs = set(re.findall(r"^CAST_KERNELS\((\w+), (\w+), (\w+)\)$", code, re.M))
    assert set(_casts._MULTI_CASTS.values()) == {f"cast_{name}_multi_tensor" for name, _, _ in pairs}
    assert set(_casts._MULTI_CASTS) == set(_casts._CASTS)
    assert f"#define CAST_TILE {cuda.CAST_TILE} " in code


def test_every_kernel_the_half_precision_launchers_name_is_a_kernel_of_half_elementwise_cu() -> None:
    code = cuda.source("half_elementwise")
    macros = re.findall(r"^HALF_VEC_KERNELS\((\w+), \w+, (\w+), \d+\)$", code, re.M)
    defined = {f"half_{kind}_{dt}_{layout}_{vec}" for dt, vec in macros for kind in ("binary", "compare")
               for layout in ("ff", "fb")} | {f"half_unary_{dt}_{vec}" for dt, vec in macros}
    named = {f"half_{kind}_{dt}_{layout}_{vec}" if layout else f"half_{kind}_{dt}_{vec}"
             for dt in _half_elementwise._SHORT.values() for vec in ("v8", "v1")
             for kind, layout in (("binary", "ff"), ("binary", "fb"), ("compare", "ff"), ("compare", "fb"),
                                  ("unary", ""))}
    assert named == defined and len(defined) == 20


def test_the_half_precision_op_codes_are_those_of_half_elementwise_cu() -> None:
    """Each launcher's op code selects the functor of the same name in the source's dispatch switches."""
    code = cuda.source("half_elementwise")

    def switch(pattern: str) -> dict[int, str]:
        return {int(c): name.lower() for c, name in re.findall(pattern, code)}

    arith = switch(r"case (\d): binary<H, Rounded<H, Op(\w+)>, SWAP")
    arith[6] = re.search(r"default: binary<H, Rounded<H, Op(\w+)>, SWAP", code).group(1).lower()  # type: ignore[union-attr]
    assert arith == {c: op for op, c in _half_elementwise.ARITHMETIC.items()}
    compare = switch(r"case (\d): binary<H, Op(\w+), false")
    compare[5] = re.search(r"default: binary<H, Op(\w+), false", code).group(1).lower()  # type: ignore[union-attr]
    assert compare == {c: op for op, c in _half_elementwise.COMPARISONS.items()}
    unary = switch(r"case (\d+): unary_loop<H, Op(\w+), VEC>")
    assert {unary[c]: c for c in _half_elementwise.UNARY.values()} == dict(_half_elementwise.UNARY)
    assert (unary[12], unary[13]) == ("square", "reciprocal")
    assert "default: unary_loop<H, OpPowScalar, VEC>" in code
    for mode in ("HOST_SCALAR", "DEVICE_SCALAR", "ROWS", "COLUMNS"):
        assert f"#define Y_{mode} {getattr(_half_elementwise, 'Y_' + mode)}\n" in code


@pytest.mark.parametrize(("a", "b", "plan"), [
    ((16, 1024, 768), (1024, 768), (False, _half_elementwise.Y_ROWS, 1024 * 768)),   # wpe over the batch
    ((1024, 768), (16, 1024, 768), (True, _half_elementwise.Y_ROWS, 1024 * 768)),
    ((16, 1024, 768), (1, 1, 768), (False, _half_elementwise.Y_ROWS, 768)),          # a bias row
    ((16, 1024, 768), (16, 1024, 1), (False, _half_elementwise.Y_COLUMNS, 768)),     # a per-row statistic
    ((16, 1, 768), (16, 1, 1), (False, _half_elementwise.Y_COLUMNS, 768)),
    ((16, 1024, 768), (), (False, _half_elementwise.Y_DEVICE_SCALAR, 1)),
    ((1,), (1, 1), (True, _half_elementwise.Y_DEVICE_SCALAR, 1)),                      # the result is (1, 1)
    ((0, 8), (8,), (False, _half_elementwise.Y_ROWS, 8)),
    ((4, 1), (1, 3), None),                                                          # both broadcast
    ((2, 3, 4), (2, 1, 4), None),                                                    # a middle dim
    ((4, 3), (4, 1, 3), None),                                                       # the result is neither
])
def test_half_precision_broadcast_plans(a: tuple[int, ...], b: tuple[int, ...],
                                        plan: tuple[bool, int, int] | None) -> None:
    assert _half_elementwise.broadcast_plan(a, b) == plan


def test_python_scalars_are_packed_as_float32_where_cupy_packs_them_so() -> None:
    import numpy as np

    got = [_half_elementwise.host_scalar(v) for v in (0.1, -2, True, float("inf"), 3.0e38, 2**53)]
    assert [type(v) for v in got] == [np.float32] * 6
    assert got[0] == np.float32(0.1) and got[1] == -2.0 and got[2] == 1.0 and got[5] == np.float32(2**53)
    assert np.isnan(_half_elementwise.host_scalar(float("nan")))  # type: ignore[arg-type]
    for declined in (1e39, -1e39, 2**53 + 1, "1", None, np.float32(1.0), 1j):
        assert _half_elementwise.host_scalar(declined) is None, declined


@pytest.mark.parametrize(("counter", "key", "expected"), ref.KNOWN_ANSWERS)
def test_philox_reference_matches_random123_known_answers(counter: tuple[int, int, int, int],
                                                          key: tuple[int, int],
                                                          expected: tuple[int, int, int, int]) -> None:
    assert ref.philox4x32_10_block(counter, key) == expected


def test_vectorized_philox_reference_agrees_with_the_single_block_one() -> None:
    words = ref.philox_words(0xDEADBEEF_12345678, 2**32 - 2, 4)
    for i in range(4):
        c = 2**32 - 2 + i
        block = ref.philox4x32_10_block((c & 0xFFFFFFFF, c >> 32, 0, 0), (0x12345678, 0xDEADBEEF))
        assert tuple(int(w) for w in words[i]) == block


@pytest.mark.parametrize(("m", "n", "k", "split"), [
    (16384, 2304, 768, False), (16384, 768, 3072, False),  # GPT-2's forward and input gradients: many tiles
    (2304, 768, 16384, True), (768, 768, 16384, True),     # its weight gradients: few tiles, long K
    (1334, 768, 50304, True),                               # an LM head chunk's input gradient
    (256, 256, 256, False),                                 # too short a K to split
])
def test_gemm_3xtf32_splits_k_only_where_the_tiles_leave_sms_idle(m: int, n: int, k: int, split: bool) -> None:
    tiles, kt = -(-m // 128) * -(-n // 128), -(-k // 32)
    splits = _gemm_3xtf32._gemm_splits(tiles, kt, m * n, 132)  # an H100 SXM
    assert (splits > 1) == split
    assert 1 <= splits <= 16 and -(-kt // splits) >= 8
    if split:  # the blocks fill at least 90 % of the waves they take
        assert tiles * splits / (-(-tiles * splits // 132) * 132) >= 0.9
