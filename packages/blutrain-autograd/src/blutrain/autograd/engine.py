"""Graph recording and the backward engine.

Recording: ``blutrain.tensor.dispatch.recorder`` is set to :func:`record`, which op functions call
only when an input requires grad. It makes one :class:`Node` per op holding the op's derivative rule,
exactly what the rule chose to save (checked against version counters at backward), and one edge
per input: to the producing node, or to the leaf tensor itself.

Backward: the nodes reachable from the roots are ordered topologically (reverse DFS post-order),
gradients are summed per (node, output) in a buffer, and each node runs once, after all of its
consumers. A node drops what it saved as soon as it ran unless ``retain_graph``; a node that saved
no tensor can run again, as in PyTorch. When only some inputs' gradients are asked for (``grad``,
``backward(inputs=...)``), nodes that lead to none of them are not run.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from blutrain.autograd.rules import RULES, Rule
from blutrain.tensor import dispatch
from blutrain.tensor.backend import is_writeable
from blutrain.tensor.errors import AutogradError, DeviceMismatchError, ShapeError, TensorTypeError
from blutrain.tensor.ops import factory
from blutrain.tensor.tensor import Storage, Tensor

Edge = tuple[Any, int]  # (Node or leaf Tensor, output index)
Hook = Callable[[Tensor], Tensor | None]
_grad_mode = dispatch.grad_mode


class _Passes(threading.local):
    """Per thread, one entry per backward pass in progress (they nest through checkpoint): whether
    the pass was asked for the gradients of given inputs only, which a recomputing rule cannot honour."""

    def __init__(self) -> None:
        self.stack: list[bool] = []


_passes = _Passes()


class Node:
    """One recorded op: its rule, what it saved, and where each input's gradient goes."""

    __slots__ = ("attrs", "edges", "freed", "hooks", "needs", "op", "out_meta", "retained", "rule", "saved",
                 "versions")

    def __init__(self, op: str, rule: Rule, edges: list[Edge | None], attrs: dict[str, Any],
                 needs: tuple[bool, ...] | None = None) -> None:
        self.op = op
        self.rule = rule
        self.edges = edges
        self.needs = tuple(e is not None for e in edges) if needs is None else needs
        self.attrs = attrs
        self.saved: tuple[Any, ...] = ()
        self.versions: tuple[tuple[Tensor, int], ...] = ()
        self.freed = False
        self.out_meta: list[tuple[tuple[int, ...], Any, Any]] = []
        self.hooks: dict[int, list[Hook]] | None = None
        self.retained: dict[int, weakref.ref[Tensor]] | None = None

    def __repr__(self) -> str:
        return f"<{self.name()}>"

    def name(self) -> str:
        """PyTorch-style name of the node, e.g. ``MulBackward``, used in error messages."""
        return self.op.title().replace("_", "") + "Backward"

    def add_tensor_hook(self, index: int, hook: Hook) -> None:
        if self.hooks is None:
            self.hooks = {}
        self.hooks.setdefault(index, []).append(hook)

    def remove_tensor_hook(self, index: int, hook: Hook) -> None:
        if self.hooks and hook in self.hooks.get(index, []):
            self.hooks[index].remove(hook)

    def retain_output_grad(self, index: int, tensor: Tensor) -> None:
        # a weak reference: the output refers to this node through grad_fn, and a strong one back
        # would make every retained tensor a reference cycle
        if self.retained is None:
            self.retained = {}
        self.retained[index] = weakref.ref(tensor)

    def free(self) -> None:
        """Drop every tensor this node keeps for backward (saved inputs/outputs, tensor attributes)."""
        if self.versions:
            self.saved = ()
            self.attrs = {k: v for k, v in self.attrs.items() if not isinstance(v, Tensor)}
            self.versions = ()
            self.freed = True

    @property
    def next_functions(self) -> tuple[tuple[Any, int] | None, ...]:
        return tuple(self.edges)


def record(op: str, inputs: tuple[Any, ...], outputs: Tensor | tuple[Tensor, ...],
           attrs: dict[str, Any]) -> None:
    """The dispatch recorder: link ``outputs`` to ``inputs`` through the derivative rule of ``op``.

    Called once per differentiable op while recording, so it is written as plain loops.
    """
    if not _grad_mode.enabled:
        return
    rule = RULES.get(op)
    if rule is None:
        raise AutogradError(f"op {op!r} has no derivative rule; call it under blutrain.autograd.no_grad() or on "
                            "tensors that do not require grad")
    edges: list[Edge | None] = []
    needs: list[bool] = []
    for t in inputs:
        if isinstance(t, Tensor):
            fn = t.grad_fn
            if fn is not None:  # an op's output: it requires grad (Tensor.set_grad_fn)
                edges.append((fn, t.output_nr))
                needs.append(True)
                continue
            if t.requires_grad:
                edges.append((t, 0))
                needs.append(True)
                continue
        edges.append(None)
        needs.append(False)
    if True not in needs:
        return
    node = Node(op, rule, edges, attrs, tuple(needs))
    single: Tensor | None = None
    if isinstance(outputs, tuple):
        outs = outputs
    else:
        single = outputs
        outs = (outputs,)
    saved = rule.save(inputs, outs, attrs)
    node.saved = saved
    versions = [(s, s.storage.version) for s in saved if isinstance(s, Tensor)] if saved else []
    if attrs:
        versions.extend((v, v.storage.version) for v in attrs.values() if isinstance(v, Tensor))
    if versions:
        node.versions = tuple(versions)
    if single is not None:  # most ops: no loop
        dtype = single.dtype
        node.out_meta.append((single.array.shape, dtype, single.device))
        if dtype.is_floating:
            single.set_grad_fn(node, 0)
        return
    meta = node.out_meta
    for i, o in enumerate(outs):
        meta.append((o.array.shape, o.dtype, o.device))
        if o.dtype.is_floating:
            o.set_grad_fn(node, i)


dispatch.set_recorder(record)


def _check_versions(node: Node) -> None:
    for t, version in node.versions:
        if t.storage.version != version:
            raise AutogradError(
                f"one of the tensors needed for gradient computation has been modified by an in-place "
                f"operation: a tensor of shape {list(t.shape)} saved by {node.name()} is at version "
                f"{t.storage.version}; expected version {version}. Make the in-place op out-of-place, or "
                "clone the tensor before modifying it.")


def _topological(roots: list[Any]) -> list[Any]:
    """Nodes and leaves reachable from ``roots``, consumers before producers."""
    order: list[Any] = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        seen.add(id(root))
        stack: list[tuple[Any, int]] = [(root, 0)]
        while stack:
            item, i = stack.pop()
            edges = item.edges if isinstance(item, Node) else ()
            while i < len(edges):
                e = edges[i]
                i += 1
                if e is not None and id(e[0]) not in seen:
                    seen.add(id(e[0]))
                    stack.append((item, i))
                    stack.append((e[0], 0))
                    break
            else:
                order.append(item)
    order.reverse()
    return order


def _needed(order: list[Any], targets: set[int]) -> set[int]:
    """Ids of the items from which some target can be reached (the targets included)."""
    need: set[int] = set()
    for item in reversed(order):  # producers first
        if id(item) in targets or (isinstance(item, Node)
                                   and any(e is not None and id(e[0]) in need for e in item.edges)):
            need.add(id(item))
    return need


def _accumulate(buffer: dict[int, list[Any]], target: Any, index: int, grad: Tensor, width: int) -> None:
    slot = buffer.get(id(target))
    if slot is None:
        slot = buffer[id(target)] = [None] * width
    slot[index] = grad if slot[index] is None else slot[index] + grad


def _owned(grad: Tensor, claimed: weakref.WeakSet[Storage]) -> Tensor:
    """``grad`` if nothing else can see its memory, else a copy: ``.grad`` is updated in place later
    (accumulation, optimizers, clipping), and one gradient tensor can reach two leaves (an add's rule
    hands the same tensor to both inputs) or be a view of another gradient. ``claimed`` holds the storages
    handed out so far weakly: one that died (a ``.grad`` a hook dropped) says nothing about a new one,
    whose ``id`` may be the same, and the choice must not depend on it (a compiled step retraces the
    same choices on every call)."""
    data = grad.array
    if grad.storage in claimed or grad.base is not None or not data.flags.c_contiguous or not is_writeable(data):
        grad = grad.clone()
    claimed.add(grad.storage)
    return grad


def _accumulate_grad(t: Tensor, grad: Tensor, claimed: weakref.WeakSet[Storage]) -> None:
    """``t.grad += grad``: in place when no graph is being built (as PyTorch's AccumulateGrad), so
    that ``.grad`` keeps its identity across backward passes; out of place under ``create_graph``."""
    old = t.grad
    if old is None:
        t.grad = _owned(grad, claimed)
    elif (not _grad_mode.enabled and old.dtype is grad.dtype and old.array.shape == grad.array.shape
          and not old.requires_grad and is_writeable(old.array)):
        old.add_(grad)
    else:
        t.grad = old + grad


def run_backward(roots: Sequence[Tensor], grads: Sequence[Tensor], *, retain_graph: bool, create_graph: bool,
                 inputs: Sequence[Tensor] | None = None, accumulate: bool = True) -> dict[int, Tensor]:
    """Propagate ``grads`` from ``roots``; accumulate into leaves' ``.grad`` (or only ``inputs``').

    Returns the gradient reaching each tensor of ``inputs``, keyed by ``id``.
    """
    buffer: dict[int, list[Any]] = {}
    starts: list[Any] = []
    for i, (t, g) in enumerate(zip(roots, grads, strict=True)):
        if not t.requires_grad:
            raise AutogradError(f"element {i} of the tensors passed to backward does not require grad and has no "
                                "grad_fn")
        target = t.grad_fn if t.grad_fn is not None else t
        width = len(target.out_meta) if isinstance(target, Node) else 1
        _accumulate(buffer, target, t.output_nr, g, width)
        starts.append(target)
    order = _topological(starts)
    wanted: dict[int, Tensor] = {}
    by_node_output: dict[tuple[int, int], Tensor] = {}
    needed: set[int] | None = None
    if inputs is not None:
        targets: set[int] = set()
        for t in inputs:
            if not isinstance(t, Tensor) or not t.requires_grad:
                raise AutogradError("one of the inputs does not require grad, so it has no gradient")
            wanted[id(t)] = t
            if t.grad_fn is None:
                targets.add(id(t))
            else:
                targets.add(id(t.grad_fn))
                by_node_output[(id(t.grad_fn), t.output_nr)] = t
        needed = _needed(order, targets)
    claimed: weakref.WeakSet[Storage] = weakref.WeakSet(g.storage for g in grads)
    captured: dict[int, Tensor] = {}
    prev = _grad_mode.enabled
    _grad_mode.enabled = create_graph
    _passes.stack.append(inputs is not None)
    try:
        for item in order:
            slot = buffer.pop(id(item), None)
            if slot is None:
                continue
            if isinstance(item, Node):
                _run_node(item, slot, buffer, retain_graph, create_graph, needed, by_node_output, captured,
                          accumulate, claimed)
            else:
                _finish_leaf(item, slot[0], wanted, captured, accumulate, claimed)
    finally:
        _passes.stack.pop()
        _grad_mode.enabled = prev
    return captured


def in_backward() -> bool:
    """Whether a backward pass is in progress on this thread: a module's forward that runs now is a
    recomputation (activation checkpointing), which hooks that track the forward order must tell apart."""
    return bool(_passes.stack)


def partial_pass() -> bool:
    """Whether the innermost backward pass in progress computes only some inputs' gradients."""
    stack = _passes.stack
    return bool(stack) and stack[-1]


def _finish_leaf(leaf: Tensor, grad: Tensor, wanted: dict[int, Tensor], captured: dict[int, Tensor],
                 accumulate: bool, claimed: weakref.WeakSet[Storage]) -> None:
    for hook in leaf.grad_hooks:
        new = hook(grad)
        if new is not None:
            grad = new
    if wanted:
        if id(leaf) not in wanted:
            return
        captured[id(leaf)] = grad
        if not accumulate:
            return
    _accumulate_grad(leaf, grad, claimed)
    for post in leaf.post_accumulate_grad_hooks:
        post(leaf)


def _run_node(node: Node, slot: list[Any], buffer: dict[int, list[Any]], retain_graph: bool, create_graph: bool,
              needed: set[int] | None, by_node_output: dict[tuple[int, int], Tensor],
              captured: dict[int, Tensor], accumulate: bool, claimed: weakref.WeakSet[Storage]) -> None:
    if node.freed:
        raise AutogradError(f"trying to backward through {node.name()} a second time (its saved tensors were "
                            "freed after the first backward); pass retain_graph=True to the first backward")
    for i, g in enumerate(slot):
        if g is None:
            continue
        if node.hooks and i in node.hooks:
            for hook in node.hooks[i]:
                new = hook(g)
                if new is not None:
                    g = new
            slot[i] = g
        if node.retained and i in node.retained:
            kept = node.retained[i]()
            if kept is not None:
                kept.grad = g.clone() if kept.grad is None else kept.grad + g
                claimed.add(kept.grad.storage)
        if by_node_output:
            t = by_node_output.get((id(node), i))
            if t is not None:
                captured[id(t)] = g
                if accumulate:
                    _accumulate_grad(t, g, claimed)
    if needed is not None and not any(e is not None and id(e[0]) in needed for e in node.edges):
        return
    _check_versions(node)
    grads = node.rule.backward(node, slot, create_graph)
    if not retain_graph:
        node.free()
    for edge, g in zip(node.edges, grads, strict=True):
        if edge is None or g is None:
            continue
        target, index = edge
        if needed is not None and id(target) not in needed:
            continue
        if isinstance(target, Node):
            shape, dtype, _ = target.out_meta[index]
            width = len(target.out_meta)
        else:
            shape, dtype, width = target.shape, target.dtype, 1
        if g.shape != shape:
            raise AutogradError(f"{node.name()} returned a gradient of shape {list(g.shape)} for an input of "
                                f"shape {list(shape)} (a derivative rule is wrong)")
        if g.dtype is not dtype:
            g = g.to(dtype=dtype)
        _accumulate(buffer, target, index, g, width)


def _seed(tensor: Tensor, gradient: Tensor | None, where: str) -> Tensor:
    """The gradient a backward pass starts from: ones for a one-element tensor, else the given one."""
    if gradient is None:
        if tensor.numel() != 1:
            raise AutogradError(f"{where}: grad can be implicitly created only for scalar outputs, got shape "
                                f"{list(tensor.shape)}; pass the gradient of the output explicitly")
        return factory.ones_like(tensor)
    if not isinstance(gradient, Tensor):
        raise TensorTypeError(f"{where}: gradient must be a Tensor, got {type(gradient).__name__}")
    if gradient.shape != tensor.shape:
        raise ShapeError(f"{where}: gradient has shape {list(gradient.shape)}, but the output has shape "
                         f"{list(tensor.shape)}")
    if gradient.device is not tensor.device:
        raise DeviceMismatchError(f"{where}: gradient is on {gradient.device}, the output on {tensor.device}")
    if gradient.dtype is not tensor.dtype:
        raise TensorTypeError(f"{where}: gradient has dtype {gradient.dtype.name}, the output has "
                              f"{tensor.dtype.name}")
    return gradient


def backward(tensor: Tensor, gradient: Tensor | None = None, *, retain_graph: bool = False,
             create_graph: bool = False, inputs: Sequence[Tensor] | None = None) -> None:
    """``tensor.backward()``: a scalar needs no gradient; any other shape needs one of its shape."""
    seed = _seed(tensor, gradient, "backward")
    if isinstance(inputs, Tensor):
        inputs = [inputs]
    run_backward([tensor], [seed], retain_graph=retain_graph or create_graph, create_graph=create_graph,
                 inputs=inputs)


def grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
         grad_outputs: Tensor | Sequence[Tensor | None] | None = None, *, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool = False) -> tuple[Tensor | None, ...]:
    """Gradients of ``outputs`` with respect to ``inputs``, without touching any ``.grad``."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is None:
        gouts: list[Tensor | None] = [None] * len(outs)
    elif isinstance(grad_outputs, Tensor):
        gouts = [grad_outputs]
    else:
        gouts = list(grad_outputs)
    if len(gouts) != len(outs):
        raise AutogradError(f"grad: got {len(gouts)} grad_outputs for {len(outs)} outputs")
    seeds = [_seed(o, g, "grad") for o, g in zip(outs, gouts, strict=True)]
    keep = create_graph if retain_graph is None else retain_graph
    got = run_backward(outs, seeds, retain_graph=keep, create_graph=create_graph, inputs=ins, accumulate=False)
    result: list[Tensor | None] = []
    for t in ins:
        g = got.get(id(t))
        if g is None and not allow_unused:
            raise AutogradError("grad: one of the inputs was not used to compute the outputs; pass "
                                "allow_unused=True to get None for it")
        result.append(g)
    return tuple(result)
