"""The ``blutrain`` MLIR dialect, defined with xDSL: one operation per catalogue op, plus the few
structural ops a traced training step needs.

Op definitions are generated from :data:`blutrain.kernels.catalogue.CATALOGUE` (one IRDL class per
op name: ``blutrain.add``, ``blutrain.layer_norm``, ...). They share one shape, because what varies
between kernels is their Python calling convention, not their IR structure: a variadic list of
tensor operands (the kernel's array arguments, flattened in argument order), a variadic list of
results, and properties:

- ``args``: the kernel's positional arguments as an array attribute, where ``N : index`` is operand
  N, ``{list = [...]}`` a Python list (multi-tensor kernels take lists of arrays), ``{slice = ...}``,
  ``{np_dtype = "float32"}`` and ``unit`` (None) stand for what their names say, and other builtin
  attributes are literal scalars, strings and tuples. Floats print exactly (hex for non-finite).
- ``ret``: how the kernel's return value maps onto the results (``N : index``, a tuple, ``unit``).
- ``device``, ``dtype``: the dispatch key (device type, compute dtype name).
- ``uid``: the traced call this op came from; ``writes``: operand indices the kernel writes in
  place; ``kernel``: the provider kernel selection picked; ``offsets``: arena offsets of the results.

Kernels that plugins register beyond the catalogue (``adamw_multi_tensor``, ``bias_gelu``, ...) are
one generic op, ``blutrain.kernel``, naming the kernel in its ``op`` property. Values are builtin
``tensor<AxBxf32>`` types: dtype and static shape. ``blutrain.view`` is a strided view of a buffer
(offset, shape and strides in elements); ``blutrain.assign`` writes into a buffer in place
(``target[key] = value``); ``blutrain.collective`` is a collective of the step, issued on its operands in
place; ``blutrain.fused`` holds a region of elementwise ops that codegen turns
into one kernel, ended by ``blutrain.yield``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from xdsl.context import Context
from xdsl.dialects import arith, builtin, func
from xdsl.dialects.builtin import (
    ArrayAttr,
    DictionaryAttr,
    FloatAttr,
    IndexType,
    IntAttr,
    IntegerAttr,
    IntegerType,
    ModuleOp,
    Signedness,
    StringAttr,
    TensorType,
    UnitAttr,
    bf16,
    f16,
    f32,
    f64,
    i1,
    i64,
)
from xdsl.ir import Attribute, Dialect, Operation
from xdsl.irdl import (
    IRDLOperation,
    irdl_op_definition,
    opt_prop_def,
    prop_def,
    region_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.parser import Parser
from xdsl.traits import IsTerminator

from blutrain.compiler.errors import CompilerError
from blutrain.tensor.dtype import DType, as_dtype

# -- element types -------------------------------------------------------------------------------
_ELEMENT: dict[str, Attribute] = {
    "bool": i1, "uint8": IntegerType(8, Signedness.UNSIGNED), "int8": IntegerType(8), "int16": IntegerType(16),
    "int32": IntegerType(32), "int64": i64, "float16": f16, "bfloat16": bf16, "float32": f32, "float64": f64,
}
_DTYPE_OF = {str(v): k for k, v in _ELEMENT.items()}


def tensor_type(shape: tuple[int, ...], dtype: DType) -> TensorType[Any]:
    """``tensor<shape x dtype>`` for a blutrain dtype."""
    return TensorType(_ELEMENT[dtype.name], list(shape))


def type_info(t: Attribute) -> tuple[tuple[int, ...], DType]:
    """(shape, dtype) of a tensor type of this dialect."""
    if not isinstance(t, TensorType):
        raise CompilerError(f"expected a tensor type, got {t}")
    return tuple(int(s) for s in t.get_shape()), as_dtype(_DTYPE_OF[str(t.element_type)])


# -- op definitions --------------------------------------------------------------------------------
def _kernel_op(name: str, doc: str, generic: bool = False) -> type[IRDLOperation]:
    fields: dict[str, Any] = {
        "name": f"blutrain.{name}",
        "__doc__": doc,
        "ins": var_operand_def(),
        "outs": var_result_def(),
        "args": prop_def(ArrayAttr),
        "ret": prop_def(Attribute),
        "device": prop_def(StringAttr),
        "dtype": prop_def(StringAttr),
        "uid": opt_prop_def(IntAttr),
        "writes": opt_prop_def(ArrayAttr),
        "kernel": opt_prop_def(StringAttr),
        "offsets": opt_prop_def(ArrayAttr),
        "dynamic": opt_prop_def(UnitAttr),
    }
    if generic:
        fields["op"] = prop_def(StringAttr)
    cls_name = "".join(part.title() for part in name.split("_")) + "Op"
    return irdl_op_definition(type(cls_name, (IRDLOperation,), fields))


def _catalogue() -> dict[str, str]:
    from blutrain.kernels.catalogue import CATALOGUE

    return {name: info.meaning for name, info in CATALOGUE.items()}


CATALOGUE_OPS: dict[str, type[IRDLOperation]] = {
    name: _kernel_op(name, f"blutrain.{name}: {meaning}") for name, meaning in _catalogue().items()}

KernelOp = _kernel_op("kernel", "A registered kernel that is not in the catalogue; ``op`` names it.", generic=True)


@irdl_op_definition
class ViewOp(IRDLOperation):
    """A strided view of ``src`` (offset, shape and strides in elements from ``src``'s first element)."""

    name = "blutrain.view"
    src = var_operand_def()
    outs = var_result_def()
    offset = prop_def(IntAttr)
    strides = prop_def(ArrayAttr)
    uid = opt_prop_def(IntAttr)


@irdl_op_definition
class AssignOp(IRDLOperation):
    """``target[key] = value`` in place; ``args`` is ``[key, value]`` in the kernel-argument encoding."""

    name = "blutrain.assign"
    ins = var_operand_def()
    args = prop_def(ArrayAttr)
    uid = opt_prop_def(IntAttr)


@irdl_op_definition
class CollectiveOp(IRDLOperation):
    """A collective of a group declared with ``blutrain.dist.traceable`` (``what``: ``"nccl all_reduce_coalesced"``):
    it reads and writes its operands in place (``writes`` names them all) and makes no value. The call that
    issues it on real arrays is not IR: the compiled function keeps it by ``uid``. Ops after it in program order
    see its result; the executor may run it beside later ops that touch none of its operands' buffers."""

    name = "blutrain.collective"
    ins = var_operand_def()
    what = prop_def(StringAttr)
    writes = prop_def(ArrayAttr)
    uid = prop_def(IntAttr)


@irdl_op_definition
class FusedOp(IRDLOperation):
    """Elementwise ops fused into one generated kernel: the region's block arguments are the inputs
    (broadcast to the iteration shape, the shape of the results), ``blutrain.yield`` gives the results."""

    name = "blutrain.fused"
    ins = var_operand_def()
    outs = var_result_def()
    body = region_def()
    offsets = opt_prop_def(ArrayAttr)


@irdl_op_definition
class YieldOp(IRDLOperation):
    """Ends a ``blutrain.fused`` region with its results."""

    name = "blutrain.yield"
    ins = var_operand_def()
    traits = traits_def(IsTerminator())


BLUTRAIN = Dialect("blutrain", [*CATALOGUE_OPS.values(), KernelOp, ViewOp, AssignOp, CollectiveOp, FusedOp, YieldOp],
                   [])
KERNEL_OPS: tuple[type[IRDLOperation], ...] = (*CATALOGUE_OPS.values(), KernelOp)


def kernel_op_class(op: str) -> type[IRDLOperation]:
    return CATALOGUE_OPS.get(op, KernelOp)


def is_kernel(op: Operation) -> bool:
    return isinstance(op, KERNEL_OPS)


def kernel_name(op: Operation) -> str:
    """The registry name of a kernel op (``add`` for ``blutrain.add``, the ``op`` property otherwise)."""
    if isinstance(op, KernelOp):
        return str(op.properties["op"].data)  # type: ignore[attr-defined]
    return op.name.removeprefix("blutrain.")


def context() -> Context:
    """An xDSL context that knows builtin, func, arith and blutrain."""
    ctx = Context()
    for d in (builtin.Builtin, func.Func, arith.Arith, BLUTRAIN):
        ctx.load_dialect(d)
    return ctx


def parse(text: str) -> ModuleOp:
    """Parse MLIR text printed from a module of this dialect."""
    return Parser(context(), text).parse_module()


# -- the kernel-argument encoding ------------------------------------------------------------------
class Operand:
    """Marks operand ``index`` in a decoded argument template."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Operand({self.index})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Operand) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("operand", self.index))


def encode(value: Any) -> Attribute:
    """A Python argument (with :class:`Operand` markers) as a builtin attribute."""
    if isinstance(value, Operand):
        return IntegerAttr(value.index, IndexType())
    if value is None:
        return UnitAttr()
    if isinstance(value, (bool, np.bool_)):
        return IntegerAttr(int(value), i1)
    if isinstance(value, np.generic):
        return DictionaryAttr({"np_scalar": ArrayAttr([StringAttr(value.dtype.name), encode(value.item())])})
    if isinstance(value, int):
        return IntegerAttr(value, i64)
    if isinstance(value, float):
        return FloatAttr(value, f64)
    if isinstance(value, str):
        return StringAttr(value)
    if isinstance(value, tuple):
        return ArrayAttr([encode(v) for v in value])
    if isinstance(value, list):
        return DictionaryAttr({"list": ArrayAttr([encode(v) for v in value])})
    if isinstance(value, slice):
        return DictionaryAttr({"slice": ArrayAttr([encode(value.start), encode(value.stop), encode(value.step)])})
    if value is Ellipsis:
        return DictionaryAttr({"ellipsis": UnitAttr()})
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return DictionaryAttr({"np_dtype": StringAttr(np.dtype(value).name)})
    if isinstance(value, DType):
        return DictionaryAttr({"dtype": StringAttr(value.name)})
    raise CompilerError(f"cannot encode a kernel argument of type {type(value).__name__} ({value!r}) in the IR")


def decode(attr: Attribute) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(attr, IntegerAttr):
        v = attr.value.data
        if isinstance(attr.type, IndexType):
            return Operand(v)
        return bool(v) if attr.type == i1 else int(v)
    if isinstance(attr, UnitAttr):
        return None
    if isinstance(attr, FloatAttr):
        return float(attr.value.data)
    if isinstance(attr, StringAttr):
        return attr.data
    if isinstance(attr, ArrayAttr):
        return tuple(decode(a) for a in attr.data)
    if isinstance(attr, DictionaryAttr):
        ((key, inner),) = attr.data.items()
        if key == "list":
            return list(decode(inner))
        if key == "slice":
            return slice(*decode(inner))
        if key == "ellipsis":
            return Ellipsis
        if key == "np_dtype":
            return as_dtype(decode(inner)).np
        if key == "dtype":
            return as_dtype(decode(inner))
        if key == "np_scalar":
            name, v = decode(inner)
            return as_dtype(name).np.type(v)
    raise CompilerError(f"cannot decode the IR attribute {attr}")


def scalars_equal(a: Any, b: Any) -> bool:
    """Equality of decoded templates where NaN equals NaN (a traced scalar may be NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(scalars_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def print_module(module: ModuleOp) -> str:
    return str(module)


__all__ = ["BLUTRAIN", "CATALOGUE_OPS", "AssignOp", "CollectiveOp", "FusedOp", "KernelOp", "Operand", "ViewOp",
           "YieldOp", "context", "decode", "encode", "is_kernel", "kernel_name", "kernel_op_class", "parse",
           "print_module", "scalars_equal", "tensor_type", "type_info"]
