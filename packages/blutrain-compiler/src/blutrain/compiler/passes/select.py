"""Kernel selection: each kernel op gets the provider of the implementation that wins for its
(op, device, dtype) in the kernel registry — the one the executor will call. A missing kernel is a
compile-time error naming the op, not a failure in the middle of a step."""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass

from blutrain.compiler.dialect import is_kernel, kernel_name
from blutrain.compiler.errors import CompilerError
from blutrain.compiler.graph import body
from blutrain.tensor.dtype import as_dtype
from blutrain.tensor.errors import KernelNotFoundError
from blutrain.tensor.kernel import kernels


class KernelSelection(ModulePass):
    name = "kernel-selection"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        registry = kernels()
        for o in body(op).ops:
            if not is_kernel(o):
                continue
            device = o.properties["device"].data
            dtype = as_dtype(o.properties["dtype"].data)
            try:
                entry = registry.lookup(kernel_name(o), device, dtype)
            except KernelNotFoundError as exc:
                raise CompilerError(f"kernel selection: {exc}") from None
            o.properties["kernel"] = StringAttr(entry.provider.plugin)


__all__ = ["KernelSelection"]
