"""AdamW against a float64 NumPy reference of PyTorch's update rule, over several steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain import nn
from blutrain.optim import OptimizerError, create, optimizers
from blutrain.tensor import DType, float32, float64, from_numpy, kernels
from blutrain_optim_adamw import AdamW, adamw_multi_tensor, adamw_step_scalars


def reference_adamw(p: np.ndarray, grads: list[np.ndarray], lrs: list[float], betas: tuple[float, float],
                    eps: float, wd: float) -> np.ndarray:
    """PyTorch's AdamW, written out in float64."""
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    b1, b2 = betas
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        p *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        p -= lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def _run(dtype: DType, shapes: list[tuple[int, ...]], steps: int, lrs: list[float], **kw: Any
         ) -> tuple[list[np.ndarray], list[np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(0)
    init = [rng.normal(size=s) for s in shapes]
    params = [nn.Parameter(from_numpy(a.astype(dtype.np))) for a in init]
    opt = AdamW([{"params": params}], lr=lrs[0], **kw)
    grads: list[list[np.ndarray]] = [[] for _ in shapes]
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for i, p in enumerate(params):
            g = rng.normal(size=shapes[i]).astype(dtype.np)
            grads[i].append(g.astype(np.float64))
            p.grad = from_numpy(g)
        opt.step()
    return init, [np.asarray(p.detach()) for p in params], grads


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_float64_updates_match_the_reference(weight_decay: float, betas: tuple[float, float]) -> None:
    shapes = [(4, 3), (5,), (2, 3, 2)]
    lrs = [1e-2, 2e-2, 5e-3, 1e-2, 3e-2, 1e-3]
    init, got, grads = _run(float64, shapes, 6, lrs, betas=betas, eps=1e-8, weight_decay=weight_decay)
    for p0, p, gs in zip(init, got, grads, strict=True):
        np.testing.assert_allclose(p, reference_adamw(p0, gs, lrs, betas, 1e-8, weight_decay), rtol=1e-12,
                                   atol=1e-14)


def test_float32_updates_match_the_reference_to_float32_rounding() -> None:
    lrs = [1e-2] * 5
    init, got, grads = _run(float32, [(16, 8)], 5, lrs, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = reference_adamw(init[0].astype(np.float32), grads[0], lrs, (0.9, 0.95), 1e-8, 0.1)
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-6)
    assert got[0].dtype == np.float32


def test_plain_parameters_get_nanogpt_decay_groups() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    opt = AdamW(model.parameters(), weight_decay=0.1)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.ndim for p in decayed["params"]] == [2, 2]
    assert plain["weight_decay"] == 0.0 and [p.ndim for p in plain["params"]] == [1, 1, 1]


def test_a_vector_in_the_no_decay_group_is_not_decayed() -> None:
    w = nn.Parameter(from_numpy(np.ones((2, 2))))
    b = nn.Parameter(from_numpy(np.ones(2)))
    opt = AdamW([w, b], lr=0.1, weight_decay=0.5)
    w.grad = from_numpy(np.zeros((2, 2)))
    b.grad = from_numpy(np.zeros(2))
    opt.step()  # zero gradients: only weight decay moves a parameter
    np.testing.assert_allclose(np.asarray(w.detach()), 1 - 0.1 * 0.5)
    np.testing.assert_array_equal(np.asarray(b.detach()), 1.0)


def test_parameters_without_gradients_are_left_alone_and_get_no_state() -> None:
    a = nn.Parameter(from_numpy(np.ones(3)))
    b = nn.Parameter(from_numpy(np.ones(3)))
    opt = AdamW([{"params": [a, b]}], lr=0.1)
    a.grad = from_numpy(np.ones(3))
    opt.step()
    np.testing.assert_array_equal(np.asarray(b.detach()), 1.0)
    assert a in opt.state and b not in opt.state


def test_a_parameter_joining_later_gets_its_own_bias_correction() -> None:
    rng = np.random.default_rng(1)
    a0, b0 = rng.normal(size=3), rng.normal(size=3)
    a, b = nn.Parameter(from_numpy(a0.copy())), nn.Parameter(from_numpy(b0.copy()))
    opt = AdamW([{"params": [a, b]}], lr=0.1, weight_decay=0.0)
    ga = [rng.normal(size=3) for _ in range(3)]
    gb = [rng.normal(size=3) for _ in range(2)]
    a.grad = from_numpy(ga[0])
    opt.step()
    for i in (1, 2):
        a.grad, b.grad = from_numpy(ga[i]), from_numpy(gb[i - 1])
        opt.step()
    ref_a = reference_adamw(a0, ga, [0.1] * 3, (0.9, 0.999), 1e-8, 0)
    ref_b = reference_adamw(b0, gb, [0.1] * 2, (0.9, 0.999), 1e-8, 0)
    np.testing.assert_allclose(np.asarray(a.detach()), ref_a, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(b.detach()), ref_b, rtol=1e-12)


def test_the_step_bumps_parameter_versions_and_records_nothing() -> None:
    p = nn.Parameter(from_numpy(np.ones(3, dtype=np.float32)))
    opt = AdamW([p], lr=0.1)
    p.grad = from_numpy(np.ones(3, dtype=np.float32))
    before = p.version
    opt.step()
    assert p.version > before and p.grad_fn is None and p.requires_grad


def test_lr_and_bias_corrections_reach_the_kernel_in_one_device_array_per_bucket() -> None:
    p = nn.Parameter(from_numpy(np.ones(3, dtype=np.float32)))
    opt = AdamW([p], lr=0.1, betas=(0.9, 0.95))
    arrays = []
    for t, lr in ((1, 0.1), (2, 0.05)):
        opt.param_groups[0]["lr"] = lr
        p.grad = from_numpy(np.ones(3, dtype=np.float32))
        opt.step()
        # asking for the values the step wrote returns its array untouched
        arrays.append(opt.step_scalars((0, 0), p.device, adamw_step_scalars(lr, 0.9, 0.95, t)))
        np.testing.assert_array_equal(arrays[-1], [lr, 1 - 0.9**t, np.sqrt(1 - 0.95**t)])
    assert arrays[0] is arrays[1]  # the same array every step: a compiled step replays one graph


def test_the_update_is_one_registered_multi_tensor_kernel() -> None:
    for dt in (float32, float64):
        entry = kernels().lookup("adamw_multi_tensor", "cpu", dt)
        assert entry.provider.distribution == "blutrain-optim-adamw"


def test_registered_by_name() -> None:
    assert optimizers().get("adamw") is AdamW
    p = nn.Parameter(from_numpy(np.ones(2)))
    assert isinstance(create("adamw", [p], lr=0.5), AdamW)


@pytest.mark.parametrize(("kw", "message"), [
    ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
    ({"eps": -1.0}, "eps must be a number >= 0, got -1.0"),
    ({"weight_decay": -0.1}, "weight_decay must be a number >= 0, got -0.1"),
    ({"lr": -1.0}, "lr must be a number >= 0, got -1.0"),
])
def test_invalid_hyperparameters_are_named(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(OptimizerError, match=message):
        AdamW([nn.Parameter(from_numpy(np.ones(2)))], **kw)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([np.float32, np.float64]), st.lists(st.integers(0, 40), min_size=1, max_size=4),
       st.floats(1e-4, 1.0), st.sampled_from([0.0, 0.1]), st.integers(0, 2**16))
def test_grad_scale_equals_scaling_the_grads_in_place_first_bit_for_bit(dtype: Any, sizes: list[int], coef: float,
                                                                         weight_decay: float, seed: int) -> None:
    """What the compiler's adamw-grad-scale pass relies on: the kernel with ``grad_scale`` is the clip's in-place
    scale_multi_tensor followed by the kernel without it, bit for bit, and leaves the gradients as they were."""
    from blutrain.tensor.cpu.kernels import scale_multi_tensor

    rng = np.random.default_rng(seed)
    p, g, m, v = ([rng.standard_normal(n).astype(dtype) * s for n in sizes] for s in (1.0, 0.5, 0.01, 1.0))
    v = [np.abs(x) for x in v]
    c = np.asarray(coef, dtype)
    scalars = np.array(adamw_step_scalars(1e-2, 0.9, 0.95, 3), np.float64)
    first = [[x.copy() for x in xs] for xs in (p, g, m, v)]
    scale_multi_tensor(first[1], c)
    adamw_multi_tensor(*first, scalars, 0.9, 0.95, 1e-8, weight_decay)
    fused = [[x.copy() for x in xs] for xs in (p, g, m, v)]
    adamw_multi_tensor(*fused, scalars, 0.9, 0.95, 1e-8, weight_decay, c)
    for got, want in zip([*fused[0], *fused[2], *fused[3]], [*first[0], *first[2], *first[3]], strict=True):
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
    for got, want in zip(fused[1], g, strict=True):
        np.testing.assert_array_equal(got, want)  # read, not written


def test_a_grad_scale_not_of_the_gradients_dtype_or_not_0d_is_refused() -> None:
    from blutrain.tensor.errors import TensorTypeError

    x = [np.ones(3, np.float32)]
    scalars = np.array(adamw_step_scalars(1e-2, 0.9, 0.95, 1), np.float64)
    for bad in (np.asarray(0.5, np.float64), np.ones(1, np.float32), 0.5):
        with pytest.raises(TensorTypeError, match="grad_scale must be a 0-d array of the gradients' dtype float32"):
            adamw_multi_tensor(x, x, x, x, scalars, 0.9, 0.95, 1e-8, 0.0, bad)
    mixed = [np.ones(3, np.float32), np.ones(2, np.float64)]
    with pytest.raises(TensorTypeError, match="grad 1 has dtype float64, grad_scale float32"):
        adamw_multi_tensor(mixed, mixed, mixed, mixed, scalars, 0.9, 0.95, 1e-8, 0.0, np.asarray(0.5, np.float32))


def test_adamw_declares_nanogpts_betas_for_the_trainer() -> None:
    assert dict(AdamW.trainer_defaults) == {"betas": (0.9, 0.95)}
    assert AdamW(nn.Linear(2, 2).parameters()).defaults["betas"] == (0.9, 0.999)  # the constructor's stay PyTorch's


def test_the_plugin_places_its_compiler_pass_before_the_aliasing_analysis_in_the_default_pipeline() -> None:
    from blutrain.compiler import CORE_PIPELINE, default_pipeline, passes
    from blutrain_optim_adamw import AdamWGradScale

    assert passes().get("adamw-grad-scale") is AdamWGradScale
    assert passes().provider("adamw-grad-scale").plugin == "adamw"
    first = CORE_PIPELINE.index("inplace-aliasing")  # after copy-elision, which only drops copies
    assert default_pipeline() == (*CORE_PIPELINE[:first], "adamw-grad-scale", *CORE_PIPELINE[first:])
    assert "adamw-grad-scale" not in CORE_PIPELINE
