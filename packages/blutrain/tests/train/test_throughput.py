"""MFU and device memory: FLOPs per token from the model family (GPT-2's here), peaks by device name, what a
CPU run reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import blutrain.tensor as bt
from blutrain.models.gpt2 import GPT2Config
from blutrain.train import Trainer
from blutrain.train.throughput import Throughput, peak_flops

from .conftest import MakeConfig


def test_flops_per_token_of_the_tiny_preset_equal_a_hand_count() -> None:
    # tiny: 4 layers, width 128, 4 heads, byte vocabulary (256); sequences of 128 tokens.
    # Forward FLOPs of one token, one multiply-add = 2 FLOPs:
    qkv = 2 * 128 * 384            # c_attn: 128 → 3 × 128
    attn_proj = 2 * 128 * 128      # c_proj of attention
    fc = 2 * 128 * 512             # mlp c_fc: 128 → 4 × 128
    mlp_proj = 2 * 512 * 128       # mlp c_proj
    scores = 2 * 128 * 128         # q · kᵀ against 128 keys of width 128 (all heads together)
    mix = 2 * 128 * 128            # the weighted sum of 128 values
    head = 2 * 128 * 256           # LM head
    forward = 4 * (qkv + attn_proj + fc + mlp_proj + scores + mix) + head
    assert forward == 1_900_544
    assert GPT2Config.preset("tiny").flops_per_token(seq_len=128) == 3 * forward  # backward = 2 × forward


def test_flops_per_token_of_gpt2_124m_follow_the_palm_formula() -> None:
    # 6N + 12·L·H·Q·T with N the weights of the GEMMs (12·L·C² in the blocks, V·C in the LM head)
    L, C, V, T = 12, 768, 50304, 1024
    n = 12 * L * C * C + V * C
    assert GPT2Config.preset("gpt2-124m").flops_per_token(seq_len=T) == 6 * n + 12 * L * C * T


@pytest.mark.parametrize(("name", "dtype", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12), ("NVIDIA H100 80GB HBM3", "fp32", 66.9e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H200", "tf32", 494.7e12), ("NVIDIA H100 NVL", "fp32", 60e12),
])
def test_peak_flops_by_device_name_and_dtype(name: str, dtype: str, peak: float) -> None:
    assert peak_flops(name, dtype) == peak


@pytest.mark.parametrize("name", ["cpu", "NVIDIA A100-SXM4-80GB", "Tesla T4", ""])
def test_an_unknown_device_has_no_peak(name: str) -> None:
    assert peak_flops(name, "bf16") is None


def test_mfu_is_the_model_flops_rate_over_the_peak_of_every_device() -> None:
    cpu = bt.device("cpu")
    meter = Throughput(flops_per_token=6_000_000, peak_per_device=1e12, devices=4, backend=cpu.backend, index=0)
    assert math.isclose(meter.metrics(tokens_per_s=100_000.0)["mfu"], 6e6 * 1e5 / 4e12, rel_tol=1e-12)


def test_a_cpu_run_reports_neither_mfu_nor_memory(make_config: MakeConfig) -> None:
    cfg = make_config(max_steps=2)
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("mfu" not in m and "mem_peak_bytes" not in m for m in rows)
