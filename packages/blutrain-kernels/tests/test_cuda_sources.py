"""What can be checked of the CUDA kernels without a GPU: the sources, their header, the registry
the device plugin reads, and the Philox reference against Random123's known answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from blutrain.kernels import cuda
from blutrain.kernels.cuda import _casts, _gemm_3xtf32
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
