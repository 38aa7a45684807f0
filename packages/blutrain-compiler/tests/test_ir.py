"""The IR: one op per catalogue op, MLIR text that parses back to the same module."""

from __future__ import annotations

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.compiler.dialect import CATALOGUE_OPS, decode, encode, parse
from blutrain.kernels.catalogue import CATALOGUE
from blutrain.nn import Linear
from blutrain.optim import create


def _compiled() -> bc.CompiledFunction:
    bt.manual_seed(0)
    model = Linear(4, 3)
    opt = create("adamw", model.parameters(), lr=1e-2)

    def step(x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
        loss = ((model(x).tanh() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = bc.compile(step)
    for _ in range(2):
        fn(bt.randn(5, 4), bt.randn(5, 3))
    return fn


def test_every_catalogue_op_has_a_dialect_op() -> None:
    assert set(CATALOGUE_OPS) == set(CATALOGUE)
    assert CATALOGUE_OPS["layer_norm"].name == "blutrain.layer_norm"


def test_compiled_ir_round_trips_through_mlir_text() -> None:
    fn = _compiled()
    text = fn.ir()
    module = parse(text)
    assert module.is_structurally_equivalent(fn.last.module)  # type: ignore[union-attr]
    assert str(module) == text


def test_traced_ir_round_trips_and_holds_the_optimizer_update() -> None:
    text = _compiled().traced_ir()
    assert '"blutrain.kernel"' in text and 'op = "adamw_multi_tensor"' in text
    assert "blutrain.linear_backward" in text
    assert str(parse(text)) == text


def test_kernel_arguments_encode_exactly() -> None:
    value = (0.1, 1 / 3, float("inf"), 7, True, None, [1, 2], slice(1, None, 2), "mean", (3, 4))
    assert decode(encode(value)) == value
