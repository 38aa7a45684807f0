"""Graph recording and the backward engine.

Recording: ``blutrain.tensor.dispatch.recorder`` is set to :func:`record`, which op functions call
only when an input requires grad. It makes one :class:`Node` per op holding the op's derivative rule,
exactly what the rule chose to save (checked against version counters at backward), and one edge
per input: to the producing node, or to the leaf tensor itself.

Backward: the nodes reachable from the roots are ordered topologically (reverse DFS post-order),
gradients are summed per (node, output) in a buffer, and each node runs once, after all of its
consumers. A node drops what it saved as soon as it ran unless ``retain_graph``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from blutrain.tensor import dispatch
from blutrain.tensor.errors import AutogradError, TensorValueError
from blutrain.tensor.ops import factory
from blutrain.tensor.tensor import Tensor

from blutrain.autograd.rules import RULES, Rule

Edge = tuple[Any, int]  # (Node or leaf Tensor, output index)
_grad_mode = dispatch.grad_mode


class Node:
    """One recorded op: its rule, what it saved, and where each input's gradient goes."""

    __slots__ = ("attrs", "edges", "hooks", "needs", "op", "out_meta", "retained", "rule", "saved", "versions")

    def __init__(self, op: str, rule: Rule, edges: list[Edge | None], attrs: dict[str, Any]) -> None:
        self.op = op
        self.rule = rule
        self.edges = edges
        self.needs = tuple(e is not None for e in edges)
        self.attrs = attrs
        self.saved: tuple[Any, ...] | None = None
        self.versions: tuple[tuple[Tensor, int], ...] = ()
        self.out_meta: list[tuple[tuple[int, ...], Any, Any]] = []
        self.hooks: dict[int, list[Callable[[Tensor], Tensor | None]]] | None = None
        self.retained: dict[int, Tensor] | None = None

    def __repr__(self) -> str:
        return f"<{self.name()}>"

    def name(self) -> str:
        return self.op.title().replace("_", "") + "Backward"

    def add_tensor_hook(self, index: int, hook: Callable[[Tensor], Tensor | None]) -> None:
        if self.hooks is None:
            self.hooks = {}
        self.hooks.setdefault(index, []).append(hook)

    def remove_tensor_hook(self, index: int, hook: Callable[[Tensor], Tensor | None]) -> None:
        if self.hooks and hook in self.hooks.get(index, []):
            self.hooks[index].remove(hook)

    def retain_output_grad(self, index: int, tensor: Tensor) -> None:
        if self.retained is None:
            self.retained = {}
        self.retained[index] = tensor

    @property
    def next_functions(self) -> tuple[tuple[Any, int] | None, ...]:
        return tuple(self.edges)


def record(op: str, inputs: tuple[Any, ...], outputs: Tensor | tuple[Tensor, ...],
           attrs: dict[str, Any]) -> None:
    """The dispatch recorder: link ``outputs`` to ``inputs`` through the derivative rule of ``op``."""
    if not _grad_mode.enabled:
        return
    rule = RULES.get(op)
    if rule is None:
        raise AutogradError(f"op {op!r} has no derivative rule; call it under blutrain.autograd.no_grad() or on "
                            "tensors that do not require grad")
    edges: list[Edge | None] = []
    any_needed = False
    for t in inputs:
        if isinstance(t, Tensor) and t._rg:
            edges.append((t.grad_fn, t._output_nr) if t.grad_fn is not None else (t, 0))
            any_needed = True
        else:
            edges.append(None)
    if not any_needed:
        return
    node = Node(op, rule, edges, attrs)
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    saved = rule.save(inputs, outs, attrs)
    node.saved = saved
    node.versions = tuple((s, s._storage.version) for s in saved if isinstance(s, Tensor))
    for i, o in enumerate(outs):
        node.out_meta.append((o.shape, o.dtype, o.device))
        if o.dtype.is_floating:
            o._rg = True
            o.grad_fn = node
            o._output_nr = i


dispatch.set_recorder(record)


def _check_versions(node: Node) -> None:
    for t, version in node.versions:
        if t._storage.version != version:
            raise AutogradError(
                f"one of the tensors needed for gradient computation has been modified by an in-place "
                f"operation: a tensor of shape {list(t.shape)} saved by {node.name()} is at version "
                f"{t._storage.version}; expected version {version}. Make the in-place op out-of-place, or "
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


def _accumulate(buffer: dict[int, list[Any]], target: Any, index: int, grad: Tensor, width: int) -> None:
    slot = buffer.get(id(target))
    if slot is None:
        slot = buffer[id(target)] = [None] * width
    slot[index] = grad if slot[index] is None else slot[index] + grad


def run_backward(roots: Sequence[Tensor], grads: Sequence[Tensor], *, retain_graph: bool, create_graph: bool,
                 inputs: Sequence[Tensor] | None = None, accumulate: bool = True) -> dict[int, Tensor]:
    """Propagate ``grads`` from ``roots``; accumulate into leaves' ``.grad`` (or only ``inputs``).

    Returns the gradient reaching each tensor of ``inputs``, keyed by ``id``.
    """
    buffer: dict[int, list[Any]] = {}
    starts: list[Any] = []
    for t, g in zip(roots, grads, strict=True):
        if not t._rg:
            raise AutogradError("element of the tensors passed to backward does not require grad and has no grad_fn")
        target = t.grad_fn if t.grad_fn is not None else t
        width = len(target.out_meta) if isinstance(target, Node) else 1
        _accumulate(buffer, target, t._output_nr, g, width)
        starts.append(target)
    wanted: dict[int, Tensor] = {}
    captured: dict[int, Tensor] = {}
    if inputs is not None:
        for t in inputs:
            if not t._rg:
                raise AutogradError("one of the inputs does not require grad")
            wanted[id(t)] = t
    claimed = {id(g._storage) for g in grads}
    by_node_output: dict[tuple[int, int], Tensor] = {}
    for t in wanted.values():
        if t.grad_fn is not None:
            by_node_output[(id(t.grad_fn), t._output_nr)] = t
    prev = _grad_mode.enabled
    _grad_mode.enabled = create_graph
    try:
        for item in _topological(starts):
            slot = buffer.pop(id(item), None)
            if slot is None:
                continue
            if not isinstance(item, Node):
                _finish_leaf(item, slot[0], wanted, captured, accumulate, claimed)
                continue
            _run_node(item, slot, buffer, retain_graph, create_graph, by_node_output, captured)
    finally:
        _grad_mode.enabled = prev
    return captured


def _finish_leaf(leaf: Tensor, grad: Tensor, wanted: dict[int, Tensor], captured: dict[int, Tensor],
                 accumulate: bool, claimed: set[int]) -> None:
    if grad.dtype is not leaf.dtype:
        grad = grad.to(dtype=leaf.dtype)
    for hook in leaf._hooks or ():
        new = hook(grad)
        if new is not None:
            grad = new
    if wanted and id(leaf) not in wanted:
        return
    if id(leaf) in wanted:
        captured[id(leaf)] = grad
        if not accumulate:
            return
    if leaf.grad is None:
        # .grad must own its storage: optimizers and clipping update it in place, and the same
        # gradient tensor can reach two leaves (an add's rule passes one tensor to both inputs).
        if id(grad._storage) in claimed:
            grad = grad.clone()
        claimed.add(id(grad._storage))
        leaf.grad = grad if _grad_mode.enabled else grad.detach()
    else:
        new_grad = leaf.grad + grad
        leaf.grad = new_grad if _grad_mode.enabled else new_grad.detach()
    for post in leaf._post_hooks or ():
        post(leaf)


def _run_node(node: Node, slot: list[Any], buffer: dict[int, list[Any]], retain_graph: bool,
              create_graph: bool, by_node_output: dict[tuple[int, int], Tensor],
              captured: dict[int, Tensor]) -> None:
    if node.saved is None:
        raise AutogradError(f"trying to backward through {node.name()} a second time (or after its saved "
                            "tensors were freed); pass retain_graph=True to the first backward")
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
            node.retained[i].grad = g.detach()
        t = by_node_output.get((id(node), i))
        if t is not None:
            captured[id(t)] = g
    _check_versions(node)
    grads = node.rule.backward(node, slot, create_graph)
    if not retain_graph:
        node.saved = None
        node.versions = ()
    for edge, g in zip(node.edges, grads, strict=True):
        if edge is None or g is None:
            continue
        target, index = edge
        width = len(target.out_meta) if isinstance(target, Node) else 1
        _accumulate(buffer, target, index, g, width)


def backward(tensor: Tensor, gradient: Tensor | None = None, *, retain_graph: bool = False,
             create_graph: bool = False, inputs: Sequence[Tensor] | None = None) -> None:
    """``tensor.backward()``: a scalar needs no gradient; any other shape needs one of its shape."""
    if gradient is None:
        if tensor.numel() != 1:
            raise AutogradError(f"backward: grad can be implicitly created only for scalar outputs, got shape "
                                f"{list(tensor.shape)}; pass gradient=")
        gradient = factory.ones_like(tensor)
    elif gradient.shape != tensor.shape:
        raise TensorValueError(f"backward: gradient has shape {list(gradient.shape)}, tensor has "
                               f"{list(tensor.shape)}")
    run_backward([tensor], [gradient], retain_graph=retain_graph or create_graph, create_graph=create_graph,
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
        raise TensorValueError(f"grad: got {len(gouts)} grad_outputs for {len(outs)} outputs")
    seeds = []
    for o, g in zip(outs, gouts, strict=True):
        if g is None:
            if o.numel() != 1:
                raise AutogradError(f"grad: grad_outputs needed for non-scalar output of shape {list(o.shape)}")
            g = factory.ones_like(o)
        seeds.append(g)
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
