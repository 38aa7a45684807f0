"""The registry the device plugin reads, assembled from the family modules: every family module imports
without CuPy, and ``KERNELS``, ``STANDALONE`` and ``__all__`` hold what the package has always offered (the
lists below are those of the single-module library the families were split from), each op served by the
launcher of its own family."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from blutrain.kernels import cuda

F2 = ("float32", "bfloat16")
F3 = ("float32", "bfloat16", "float16")
PACKAGE = "blutrain.kernels.cuda"
HALF_OPS = ("add", "sub", "mul", "div", "maximum", "minimum", "pow", "eq", "ne", "lt", "le", "gt", "ge", "neg",
            "abs", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "tanh", "sin", "cos", "relu")

# op -> (family module, launcher, dtype names), in registration order
KERNELS = {
    "layer_norm": ("_layernorm", "layer_norm", F2),
    "layer_norm_backward": ("_layernorm", "layer_norm_backward", F2),
    "gelu": ("_gelu", "gelu", F2),
    "gelu_backward": ("_gelu", "gelu_backward", F2),
    "bias_gelu": ("_gelu", "bias_gelu", F2),
    "bias_gelu_backward": ("_gelu", "bias_gelu_backward", F2),
    "cross_entropy": ("_cross_entropy", "cross_entropy", F2),
    "cross_entropy_backward": ("_cross_entropy", "cross_entropy_backward", F2),
    "softmax": ("_softmax", "softmax", F2),
    "log_softmax": ("_softmax", "log_softmax", F2),
    "softmax_backward": ("_softmax", "softmax_backward", F2),
    "log_softmax_backward": ("_softmax", "log_softmax_backward", F2),
    "embedding": ("_embedding", "embedding", F2),
    "embedding_backward": ("_embedding", "embedding_backward", F2),
    "sum": ("_reduce", "sum", F2),
    "sdpa": ("_attention", "sdpa", F2),
    "sdpa_backward": ("_attention", "sdpa_backward", F2),
    "sdpa_packed": ("_attention", "sdpa_packed", F2),
    "sdpa_packed_backward": ("_attention", "sdpa_packed_backward", F2),
    "cast": ("_casts", "cast", F3),
    "rms_norm": ("llama", "rms_norm", F2),
    "rms_norm_backward": ("llama", "rms_norm_backward", F2),
    "rope": ("llama", "rope", F2),
    "rope_backward": ("llama", "rope_backward", F2),
    "swiglu": ("llama", "swiglu", F2),
    "swiglu_backward": ("llama", "swiglu_backward", F2),
    # the half-precision elementwise ops, one launch each (launchers made per op, reached through the table)
    **{op: ("_half_elementwise", op, ("bfloat16", "float16")) for op in HALF_OPS},
}
STANDALONE = {
    "adamw_multi_tensor": ("_adamw", "adamw_multi_tensor", ("float32",)),
    "scale_multi_tensor": ("_scale", "scale_multi_tensor", F2),
    "norm_multi_tensor": ("_scale", "norm_multi_tensor", F2),
    "cast_multi_tensor": ("_casts", "cast_multi_tensor", F3),
}
PUBLIC = [
    "ADAMW_TILE", "CAST_TILE", "FAMILIES", "GEMM_3XTF32_MIN_FLOPS", "KERNELS", "PHILOX_PER_COUNTER", "SCALE_TILE",
    "STANDALONE", "adamw_multi_tensor", "bias_gelu", "bias_gelu_backward", "cast", "cast_multi_tensor",
    "cross_entropy", "cross_entropy_backward", "cross_entropy_rows", "cross_entropy_with_grad", "embedding",
    "embedding_backward", "function", "gelu", "gelu_backward", "gemm_3xtf32", "is_deterministic", "layer_norm",
    "layer_norm_backward", "layer_norm_residual", "log_softmax", "log_softmax_backward", "module",
    "norm_multi_tensor", "philox", "scale_multi_tensor", "sdpa", "sdpa_backward", "sdpa_packed",
    "sdpa_packed_backward", "set_deterministic", "sm_count", "softmax", "softmax_backward", "source", "sum",
    "sum_cols", "sum_rows",
]
# used by name outside the package though not in __all__ (the tools, the llama family's tests)
ALSO_PUBLIC = ["HOPPER_FAMILIES", "hopper_module", "llama"]
MODULES = sorted(p.stem for p in Path(cuda.__file__).parent.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_every_module_of_the_folder_imports(name: str) -> None:
    assert importlib.import_module(f"{PACKAGE}.{name}").__name__ == f"{PACKAGE}.{name}"


def test_the_family_modules_are_the_expected_ones() -> None:
    families = {module for module, _, _ in (*KERNELS.values(), *STANDALONE.values())}
    assert families | {"_core", "_plans", "_gemm_3xtf32", "_philox", "philox_reference"} == set(MODULES)


@pytest.mark.parametrize(("table", "expected"), [(cuda.KERNELS, KERNELS), (cuda.STANDALONE, STANDALONE)],
                         ids=["KERNELS", "STANDALONE"])
def test_the_registry_holds_the_same_ops_in_the_same_order_each_from_its_family(
        table: dict[str, tuple[object, tuple[str, ...]]],
        expected: dict[str, tuple[str, str, tuple[str, ...]]]) -> None:
    assert list(table) == list(expected)
    for op, (module, launcher, dtypes) in expected.items():
        fn, names = table[op]
        family = importlib.import_module(f"{PACKAGE}.{module}")
        assert fn is (family.LAUNCHERS[op] if module == "_half_elementwise" else getattr(family, launcher)), op
        assert names == dtypes, op


def test_the_package_exports_the_same_public_names_as_before_the_split() -> None:
    assert cuda.__all__ == PUBLIC
    for name in (*PUBLIC, *ALSO_PUBLIC):
        assert getattr(cuda, name) is not None, name
    for op, (module, launcher, _) in {**KERNELS, **STANDALONE}.items():
        if module not in ("llama", "_half_elementwise"):  # those are reached through their module or the table
            assert getattr(cuda, launcher) is getattr(importlib.import_module(f"{PACKAGE}.{module}"), launcher), op


def test_the_families_tables_do_not_overlap() -> None:
    seen: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(f"{PACKAGE}.{name}")
        seen += [*getattr(mod, "KERNELS", {}), *getattr(mod, "STANDALONE", {})]
    assert sorted(seen) == sorted([*KERNELS, *STANDALONE])


def test_importing_every_family_imports_no_cupy() -> None:
    code = (f"import importlib, sys\nfor m in {MODULES!r}:\n    importlib.import_module('{PACKAGE}.' + m)\n"
            "assert 'cupy' not in sys.modules, sorted(m for m in sys.modules if 'cupy' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
