"""A trace as a ``blutrain``-dialect module: one ``func.func @step`` whose arguments are the inputs
and then the state buffers, whose ops are the recorded calls in program order, and which returns
the function's outputs.

Ops may write their operands in place (``writes``; ``blutrain.assign``; ``blutrain.collective``, a collective
of a group declared with ``blutrain.dist.traceable``): the IR keeps program order,
and the passes respect it (:mod:`blutrain.compiler.passes.aliasing`). The module's attributes say how
many arguments are inputs (``blutrain.inputs``) and the device (``blutrain.device``).
"""

from __future__ import annotations

from typing import Any

from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, FunctionType, IntAttr, ModuleOp, StringAttr
from xdsl.ir import Block, Operation, Region, SSAValue

from blutrain.compiler.dialect import AssignOp, CollectiveOp, KernelOp, ViewOp, encode, kernel_op_class, tensor_type
from blutrain.compiler.trace import Tracer


def trace_module(fn: Any, *arrays: Any) -> ModuleOp:
    """The module of ``fn`` traced with CPU tensors of ``arrays`` (NumPy arrays) as its inputs, before any
    pass: a small graph to run a pass on (``run_pipeline(trace_module(f, a), ["my-pass"])``) and look at.
    ``fn`` takes tensors and returns a tensor or a tuple of them."""
    import blutrain.tensor as bt
    from blutrain.compiler.trace import tracing
    from blutrain.tensor import capture

    tracer = Tracer()
    with tracing(tracer):
        tensors = [bt.from_numpy(a) for a in arrays]
        with capture.substitute_arrays(tensors, [tracer.add_input(t.array) for t in tensors]):
            out = fn(*tensors)
    outs = out if isinstance(out, tuple) else (out,)
    return build_module(tracer, [o.array.vid for o in outs])


def build_module(tracer: Tracer, outputs: list[int], dynamic: frozenset[int] = frozenset()) -> ModuleOp:
    """The module of a finished trace; ``outputs`` are the vids the function returns. Ops whose
    uid is in ``dynamic`` carry the ``dynamic`` property (their scalars change between calls)."""
    values = tracer.values
    args = [*tracer.inputs, *tracer.state_order]
    block = Block(arg_types=[tensor_type(values[v].shape, values[v].dtype) for v in args])
    ssa: dict[int, SSAValue] = dict(zip(args, block.args, strict=True))
    for ev in tracer.events:
        operands = [ssa[v] for v in ev.operands]
        types = [tensor_type(values[v].shape, values[v].dtype) for v in ev.results]
        op: Operation
        if ev.kind == "view":
            _, offset, _, strides = ev.template
            op = ViewOp.create(operands=operands, result_types=types,
                               properties={"offset": IntAttr(offset), "strides": encode(tuple(strides)),
                                           "uid": IntAttr(ev.uid)})
        elif ev.kind == "collective":
            # every operand counts as written, whatever the traced call changed: a collective whose result came
            # out equal to its input on this call (ranks that hold the same gradient) still writes it
            op = CollectiveOp.create(operands=operands,
                                     properties={"what": StringAttr(ev.op), "uid": IntAttr(ev.uid),
                                                 "writes": ArrayAttr([IntAttr(i) for i in range(len(operands))])})
        elif ev.kind == "assign":
            op = AssignOp.create(operands=operands,
                                 properties={"args": encode(tuple(ev.template)), "uid": IntAttr(ev.uid)})
        else:
            cls = kernel_op_class(ev.op)
            props = {"args": encode(tuple(ev.template)), "ret": encode(ev.ret), "device": StringAttr(ev.device),
                     "dtype": StringAttr(ev.dtype), "uid": IntAttr(ev.uid)}
            if cls is KernelOp:
                props["op"] = StringAttr(ev.op)
            if ev.writes:
                props["writes"] = ArrayAttr([IntAttr(i) for i in ev.writes])
            if ev.uid in dynamic:
                props["dynamic"] = encode(None)
            op = cls.create(operands=operands, result_types=types, properties=props)
        block.add_op(op)
        for vid, res in zip(ev.results, op.results, strict=True):
            ssa[vid] = res
    block.add_op(func.ReturnOp(*[ssa[v] for v in outputs]))
    ftype = FunctionType.from_lists([a.type for a in block.args], [ssa[v].type for v in outputs])
    fn = func.FuncOp("step", ftype, Region(block))
    module = ModuleOp([fn])
    module.attributes["blutrain.inputs"] = IntAttr(len(tracer.inputs))
    module.attributes["blutrain.device"] = StringAttr(tracer.device or "cpu")
    return module


def step_function(module: ModuleOp) -> func.FuncOp:
    for op in module.ops:
        if isinstance(op, func.FuncOp):
            return op
    raise ValueError("the module has no func.func")


def body(module: ModuleOp) -> Block:
    return step_function(module).body.block


def attr_int(module: ModuleOp, name: str) -> int:
    a: Any = module.attributes[name]
    return int(a.data)


__all__ = ["attr_int", "body", "build_module", "step_function"]
