"""Data types and the promotion rules between them.

A :class:`DType` is BluTrain's truth about element type; backends map it to their own (NumPy and
CuPy share NumPy dtypes; bfloat16 is ml_dtypes' on both). Promotion follows PyTorch:

* Categories rank bool < integer < floating. Between two tensors the result is the smallest type
  that holds both (``promote_types``): uint8 + int8 → int16, float16 + bfloat16 → float32, any
  integer + float16 → float16.
* In a mixed expression, tensors with dimensions outrank zero-dimensional tensors, which outrank
  Python scalars: a lower-priority operand only changes the result if it is of a higher category
  (float32 tensor * float64 scalar tensor → float32; int64 tensor * 2.5 → the default float dtype).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from blutrain.tensor.errors import TensorTypeError


class DType:
    """An element type: name, size, category, and the NumPy dtype that stores it."""

    __slots__ = ("is_floating", "is_signed", "itemsize", "name", "np", "rank")

    def __init__(self, name: str, np_dtype: Any, is_floating: bool, is_signed: bool, rank: int) -> None:
        self.name: str = name
        self.np: np.dtype[Any] = np.dtype(np_dtype)
        self.itemsize: int = int(self.np.itemsize)
        self.is_floating: bool = is_floating
        self.is_signed: bool = is_signed
        self.rank: int = rank  # position in the promotion lattice, used only to order the table

    @property
    def category(self) -> int:
        """0 bool, 1 integer, 2 floating."""
        if self.name == "bool":
            return 0
        return 2 if self.is_floating else 1

    def __repr__(self) -> str:
        return f"blutrain.{self.name}"

    def __reduce__(self) -> str:
        return self.name


bool_ = DType("bool", np.bool_, False, False, 0)
uint8 = DType("uint8", np.uint8, False, False, 1)
int8 = DType("int8", np.int8, False, True, 2)
int16 = DType("int16", np.int16, False, True, 3)
int32 = DType("int32", np.int32, False, True, 4)
int64 = DType("int64", np.int64, False, True, 5)
float16 = DType("float16", np.float16, True, True, 6)
bfloat16 = DType("bfloat16", ml_dtypes.bfloat16, True, True, 7)
float32 = DType("float32", np.float32, True, True, 8)
float64 = DType("float64", np.float64, True, True, 9)

ALL_DTYPES: tuple[DType, ...] = (bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64)
FLOATING_DTYPES: tuple[DType, ...] = (float16, bfloat16, float32, float64)
INTEGER_DTYPES: tuple[DType, ...] = (uint8, int8, int16, int32, int64)
NUMERIC_DTYPES: tuple[DType, ...] = tuple(d for d in ALL_DTYPES if d is not bool_)
# Half precision: kernels compute in float32 and round once to the storage dtype.
HALF_DTYPES: tuple[DType, ...] = (float16, bfloat16)

# The same groups by name, for code that holds an array's dtype (``a.dtype.name`` is the same on NumPy and
# CuPy, ml_dtypes' bfloat16 included) or a dtype attribute of compiled IR rather than a DType.
FLOATING_NAMES: frozenset[str] = frozenset(d.name for d in FLOATING_DTYPES)
HALF_NAMES: frozenset[str] = frozenset(d.name for d in HALF_DTYPES)

# Unary ops defined only on floating inputs: an integer input is first promoted to the default float dtype.
FLOAT_UNARY_OPS: tuple[str, ...] = ("exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "tanh", "sin", "cos", "sigmoid",
                                    "silu", "erf", "gelu")

_BY_NAME: dict[str, DType] = {d.name: d for d in ALL_DTYPES}
_BY_NAME.update({"bool_": bool_, "half": float16, "float": float32, "double": float64, "long": int64,
                 "int": int32, "bf16": bfloat16, "fp16": float16, "fp32": float32, "fp64": float64})
_BY_NP: dict[np.dtype[Any], DType] = {d.np: d for d in ALL_DTYPES}
# Every string ``as_dtype`` accepts: the canonical names and their aliases.
DTYPE_NAMES: frozenset[str] = frozenset(_BY_NAME)


def _promote_pair(a: DType, b: DType) -> DType:
    if a is b:
        return a
    if a.category != b.category:
        return a if a.category > b.category else b
    if a.category == 0:
        return bool_
    if a.category == 2:
        if {a, b} == {float16, bfloat16}:
            return float32
        return a if a.itemsize > b.itemsize else b
    # integers
    if a.is_signed == b.is_signed:
        return a if a.itemsize > b.itemsize else b
    unsigned, signed = (a, b) if not a.is_signed else (b, a)
    if signed.itemsize > unsigned.itemsize:
        return signed
    return {1: int16, 2: int32, 4: int64, 8: int64}[unsigned.itemsize]


# The whole table, built once, so promotion in the per-op path is one dict lookup.
PROMOTION_TABLE: dict[tuple[DType, DType], DType] = {
    (a, b): _promote_pair(a, b) for a in ALL_DTYPES for b in ALL_DTYPES
}

_default_float = float32


def promote_types(a: DType, b: DType) -> DType:
    """The smallest dtype both ``a`` and ``b`` convert to without losing their category."""
    return PROMOTION_TABLE[(a, b)]


def get_default_dtype() -> DType:
    """The floating dtype of factories and of float scalars mixed with integer tensors."""
    return _default_float


def set_default_dtype(dtype: DType) -> None:
    global _default_float
    dtype = as_dtype(dtype, "dtype")
    if not dtype.is_floating:
        raise TensorTypeError(f"set_default_dtype: dtype must be floating, got {dtype}")
    _default_float = dtype


def scalar_dtype(value: object) -> DType:
    """The dtype a Python scalar takes when it stands alone (bool, int64, default float)."""
    if isinstance(value, bool):
        return bool_
    if isinstance(value, int):
        return int64
    if isinstance(value, float):
        return _default_float
    raise TensorTypeError(f"expected a Python bool, int or float scalar, got {type(value).__name__}")


def as_dtype(value: object, argument: str = "dtype") -> DType:
    """Accept a DType, its name, or a NumPy dtype; anything else is an error naming ``argument``."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = _BY_NAME.get(value)
        if found is not None:
            return found
        known = ", ".join(d.name for d in ALL_DTYPES)
        raise TensorTypeError(f"{argument}: unknown dtype {value!r}; expected one of {known}")
    try:
        npd = np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        npd = None
    if npd is not None and npd in _BY_NP:
        return _BY_NP[npd]
    raise TensorTypeError(f"{argument}: expected a blutrain dtype, got {value!r}")


def from_numpy_dtype(npd: np.dtype[Any]) -> DType:
    found = _BY_NP.get(npd)
    if found is None:
        raise TensorTypeError(f"NumPy dtype {npd} has no BluTrain equivalent; supported: "
                              f"{', '.join(str(d.np) for d in ALL_DTYPES)}")
    return found


__all__ = [
    "ALL_DTYPES",
    "DTYPE_NAMES",
    "FLOATING_DTYPES",
    "FLOATING_NAMES",
    "FLOAT_UNARY_OPS",
    "HALF_DTYPES",
    "HALF_NAMES",
    "INTEGER_DTYPES",
    "NUMERIC_DTYPES",
    "PROMOTION_TABLE",
    "DType",
    "as_dtype",
    "bfloat16",
    "bool_",
    "float16",
    "float32",
    "float64",
    "from_numpy_dtype",
    "get_default_dtype",
    "int8",
    "int16",
    "int32",
    "int64",
    "promote_types",
    "scalar_dtype",
    "set_default_dtype",
    "uint8",
]
