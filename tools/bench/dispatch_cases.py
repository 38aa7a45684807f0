"""The op set of tools/bench_dispatch.py, written once for BluTrain and PyTorch.

Each framework is a :class:`Framework`: a table of the function objects its users call (``F.linear`` or
``blutrain.tensor.linear``, ...) plus factories. A case's timed callable calls those function objects
directly, with the same arguments in both frameworks, so the two rows of a case differ only in the framework.

Shapes: ``small`` keeps the arithmetic negligible, so the time per call is the framework's host cost;
``gpt2`` is GPT-2 124M's training shape (micro-batch 16 × 1024, 768 wide, 12 heads, vocabulary 50304), where
on cuda the device time becomes visible beside the host time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The op set, in table order. "attention" is scaled-dot-product attention over (B, H, T, D) heads, causal;
# "attention_packed" is what GPT-2's block runs: BluTrain's one ``self_attention`` op over the packed
# (B, T, 3C) projection against nanoGPT's split / view / transpose / SDPA / merge in PyTorch.
FORWARD_OPS = ("add", "mul", "cast_to_bf16", "cast_to_fp32", "matmul", "linear", "layer_norm", "gelu", "attention",
               "attention_packed", "cross_entropy", "embedding")
STEP_OPS = ("adamw",)
OPS = (*FORWARD_OPS, *STEP_OPS)

# A case is (op, pass, requires_grad). "forward" runs the op; "backward" times ``y.backward(seed,
# retain_graph=True)`` of the one-op graph ``y = op(inputs)`` built once (the leaves' ``.grad`` set to None
# before each call, so nothing accumulates): the engine's walk, the op's derivative rule and the gradients
# set on the leaves; "step" is one optimizer step.
PASSES = ("forward", "backward", "step")


@dataclass(frozen=True)
class Shapes:
    """One size of the op set: activations (batch, seq, embd), ``heads`` heads, a ``vocab``-row embedding."""

    name: str
    batch: int
    seq: int
    embd: int
    heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


# small: one head of GPT-2's head dim 64, the smallest the fused attention kernels take, so that on cuda the
# small shapes run the same kernels as GPT-2's (a head dim they do not cover would time the generic fallback)
SHAPES = {"small": Shapes("small", 2, 8, 64, 1, 64), "gpt2": Shapes("gpt2", 16, 1024, 768, 12, 50304)}


@dataclass(frozen=True)
class Case:
    op: str
    pass_: str
    requires_grad: bool

    @property
    def label(self) -> str:
        if self.pass_ == "forward":
            return f"{self.op} (grad)" if self.requires_grad else self.op
        return f"{self.op} {'bwd' if self.pass_ == 'backward' else 'step'}"


def cases() -> list[Case]:
    """Every case of the set: each forward op without and with requires_grad, its backward, the AdamW step."""
    out = []
    for op in FORWARD_OPS:
        out += [Case(op, "forward", False), Case(op, "forward", True), Case(op, "backward", True)]
    out += [Case(op, "step", True) for op in STEP_OPS]
    return out


@dataclass
class Framework:
    """What a case needs from one framework on one device, in one compute dtype."""

    name: str
    version: str
    device: str
    dtype: Any
    bf16: Any
    fp32: Any
    randn: Callable[[tuple[int, ...], Any, bool], Any]
    randint: Callable[[int, tuple[int, ...]], Any]
    ones_like: Callable[[Any], Any]
    matmul: Callable[..., Any]
    linear: Callable[..., Any]
    layer_norm: Callable[..., Any]
    gelu: Callable[..., Any]
    attention: Callable[..., Any]
    attention_packed: Callable[[Any, int], Any]
    cross_entropy: Callable[..., Any]
    embedding: Callable[..., Any]
    adamw: Callable[[list[Any]], Any]
    synchronize: Callable[[], None]


@dataclass
class Prepared:
    """A case ready to time: ``call`` does one op; ``shape`` says its main operand's shape."""

    call: Callable[[], Any]
    shape: str


def _dims(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape)


def _forward(fw: Framework, op: str, s: Shapes, rg: bool) -> tuple[Callable[[], Any], tuple[Any, ...], str]:
    """The op's call, its leaves that require grad, and its shape."""
    B, T, C, H, V = s.batch, s.seq, s.embd, s.heads, s.vocab
    act, dt = (B, T, C), fw.dtype
    if op in ("add", "mul"):
        a, b = fw.randn(act, dt, rg), fw.randn(act, dt, rg)
        return ((lambda: a + b) if op == "add" else (lambda: a * b)), (a, b), _dims(act)
    if op in ("cast_to_bf16", "cast_to_fp32"):
        src, dst = (fw.fp32, fw.bf16) if op == "cast_to_bf16" else (fw.bf16, fw.fp32)
        x = fw.randn(act, src, rg)
        return (lambda: x.to(dst)), (x,), _dims(act)
    if op == "matmul":
        a, w = fw.randn((B * T, C), dt, rg), fw.randn((C, C), dt, rg)
        return (lambda: a @ w), (a, w), f"{B * T}×{C} @ {C}×{C}"
    if op == "linear":  # GPT-2's c_fc: C → 4C with bias
        x, w, bias = fw.randn(act, dt, rg), fw.randn((4 * C, C), dt, rg), fw.randn((4 * C,), dt, rg)
        linear = fw.linear
        return (lambda: linear(x, w, bias)), (x, w, bias), f"{_dims(act)} → {4 * C}"
    if op == "layer_norm":
        x, w, bias = fw.randn(act, dt, rg), fw.randn((C,), dt, rg), fw.randn((C,), dt, rg)
        layer_norm, ns = fw.layer_norm, (C,)
        return (lambda: layer_norm(x, ns, w, bias)), (x, w, bias), _dims(act)
    if op == "gelu":  # on c_fc's output, tanh approximation as GPT-2
        x = fw.randn((B, T, 4 * C), dt, rg)
        gelu = fw.gelu
        return (lambda: gelu(x, approximate="tanh")), (x,), _dims((B, T, 4 * C))
    if op == "attention":
        heads = (B, H, T, s.head_dim)
        q, k, v = fw.randn(heads, dt, rg), fw.randn(heads, dt, rg), fw.randn(heads, dt, rg)
        attention = fw.attention
        return (lambda: attention(q, k, v, is_causal=True)), (q, k, v), _dims(heads)
    if op == "attention_packed":
        qkv = fw.randn((B, T, 3 * C), dt, rg)
        packed = fw.attention_packed
        return (lambda: packed(qkv, H)), (qkv,), f"{_dims((B, T, 3 * C))}, {H} heads"
    if op == "cross_entropy":  # GPT-2's loss over the flattened logits
        logits, target = fw.randn((B * T, V), dt, rg), fw.randint(V, (B * T,))
        cross_entropy = fw.cross_entropy
        return (lambda: cross_entropy(logits, target)), (logits,), _dims((B * T, V))
    if op == "embedding":
        index, weight = fw.randint(V, (B, T)), fw.randn((V, C), dt, rg)
        embedding = fw.embedding
        return (lambda: embedding(index, weight)), (weight,), f"{_dims((B, T))} of {V}×{C}"
    raise ValueError(f"unknown forward op {op!r}; known: {', '.join(FORWARD_OPS)}")


def block_parameter_shapes(s: Shapes) -> list[tuple[int, ...]]:
    """The 12 parameters of one GPT-2 block (attention and MLP linears with biases, two LayerNorms)."""
    C = s.embd
    return [(3 * C, C), (3 * C,), (C, C), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,), (C,), (C,), (C,), (C,)]


def prepare(fw: Framework, case: Case, s: Shapes) -> Prepared:
    """The timed callable of one case, its inputs made once (random, on ``fw.device``)."""
    if case.pass_ == "step":
        shapes = block_parameter_shapes(s)
        # float32 parameters whatever the compute dtype: mixed-precision training steps its float32 masters
        params = [fw.randn(shape, fw.fp32, True) for shape in shapes]
        for p in params:
            p.grad = fw.randn(tuple(p.shape), fw.fp32, False)
        step = fw.adamw(params).step
        return Prepared(step, f"{len(params)} params, {sum(_numel(x) for x in shapes):,} values")
    call, leaves, shape = _forward(fw, case.op, s, case.requires_grad)
    if case.pass_ == "forward":
        return Prepared(call, shape)
    out = call()
    seed = fw.ones_like(out)

    def backward() -> None:
        for leaf in leaves:
            leaf.grad = None
        out.backward(seed, retain_graph=True)

    return Prepared(backward, shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- the frameworks ---------------------------------------------------------------------------------------------
def blutrain_framework(device: str, dtype: str) -> Framework:
    """BluTrain on ``device`` ("cpu", "cuda"): its public ops, the "adamw" optimizer plugin through the registry."""
    from importlib.metadata import version

    import blutrain.autograd  # noqa: F401  installs the recorder, as a training script's imports do
    import blutrain.optim as optim
    import blutrain.tensor as bt

    dev = bt.device(device)
    bt.zeros((1,), device=dev)  # an unusable device raises its backend's one-line error here, before any case
    compute = bt.as_dtype(dtype)

    def randn(shape: tuple[int, ...], dt: Any, requires_grad: bool) -> Any:
        return bt.randn(shape, dtype=dt, device=dev, requires_grad=requires_grad)

    return Framework(
        name="blutrain", version=version("blutrain-tensor"), device=device, dtype=compute, bf16=bt.bfloat16,
        fp32=bt.float32, randn=randn, randint=lambda high, shape: bt.randint(0, high, shape, device=dev),
        ones_like=bt.ones_like, matmul=bt.matmul, linear=bt.linear, layer_norm=bt.layer_norm, gelu=bt.gelu,
        attention=bt.scaled_dot_product_attention,
        attention_packed=lambda qkv, n_head: bt.self_attention(qkv, n_head, is_causal=True),
        cross_entropy=bt.cross_entropy, embedding=bt.embedding,
        adamw=lambda params: optim.create("adamw", params, lr=1e-4, weight_decay=0.1),
        synchronize=lambda: dev.backend.synchronize(dev.index or 0))


def torch_framework(device: str, dtype: str) -> Framework:
    """PyTorch on ``device``, as nanoGPT calls it (``torch.optim.AdamW(fused=True)``, as tools/bench/gpt2.py)."""
    torch = importlib.import_module("torch")  # optional: not a dependency of the workspace
    F = torch.nn.functional

    dev = torch.device(device)
    compute = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    def randn(shape: tuple[int, ...], dt: Any, requires_grad: bool) -> Any:
        return torch.randn(shape, dtype=dt, device=dev, requires_grad=requires_grad)

    def attention_packed(qkv: Any, n_head: int) -> Any:
        B, T, C3 = qkv.shape
        C = C3 // 3
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, C)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    return Framework(
        name="torch", version=torch.__version__, device=device, dtype=compute, bf16=torch.bfloat16,
        fp32=torch.float32, randn=randn, randint=lambda high, shape: torch.randint(0, high, shape, device=dev),
        ones_like=torch.ones_like, matmul=torch.matmul, linear=F.linear, layer_norm=F.layer_norm, gelu=F.gelu,
        attention=F.scaled_dot_product_attention, attention_packed=attention_packed,
        cross_entropy=F.cross_entropy, embedding=F.embedding,
        adamw=lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True),
        synchronize=sync)
