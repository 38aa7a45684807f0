"""Time BluTrain's fused CUDA kernels against PyTorch's equivalents on the same random data.

    python3 tools/bench_kernels.py [--quick] [--out results.json] [--only attention,gelu,...]

Runs on a machine with an NVIDIA GPU, CuPy and PyTorch. Both sides read the very same device memory
(CuPy arrays are views of the PyTorch tensors). Each time is the median over trials of a batch of
back-to-back calls between two CUDA events, after a warm-up; inputs rotate among several copies
when one set would fit in L2, so that the numbers are DRAM numbers. The ceilings are measured first:
a device-to-device copy (bytes read + written) and 8192^3 GEMMs in float32 (TF32 off) and bfloat16.

Columns: op, shape, dtype, ours (ms), torch (ms), ours/torch (< 1: ours faster), achieved GB/s or
TFLOP/s (ours), % of the measured ceiling, and the relative error of ours against torch's output.
The full table is printed, then a summary per kernel; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

Fn = Callable[[], Any]


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    ours_ms: float | None = None
    torch_ms: float | None = None
    rate: float | None = None  # GB/s or TFLOP/s of ours
    unit: str = ""
    pct_ceiling: float | None = None
    rel_err: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.ours_ms is None or self.torch_ms is None or self.torch_ms == 0:
            return None
        return self.ours_ms / self.torch_ms


class Bench:
    def __init__(self, quick: bool) -> None:
        import cupy as cp
        import torch

        self.cp = cp
        self.torch = torch
        self.quick = quick
        self.trials = 5 if quick else 9
        props = torch.cuda.get_device_properties(0)
        self.device_name = props.name
        self.l2_bytes = int(getattr(props, "L2_cache_size", 50 * 2**20))
        self.ceilings: dict[str, float] = {}

    # ------------------------------------------------------------------------------------- plumbing

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def free(self) -> None:
        self.sync()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.torch.cuda.empty_cache()

    def as_cupy(self, t: Any) -> Any:
        """A CuPy view of a contiguous torch tensor (bfloat16 included), sharing its memory."""
        cp = self.cp
        import ml_dtypes
        import numpy as np

        assert t.is_contiguous()
        dtype = {"torch.float32": np.float32, "torch.bfloat16": ml_dtypes.bfloat16, "torch.int64": np.int64,
                 "torch.float64": np.float64, "torch.float16": np.float16}[str(t.dtype)]
        mem = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t)
        return cp.ndarray(tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def copies(self, bytes_per_set: int) -> int:
        """Input sets to rotate so that the working set is at least 3x the L2."""
        return max(1, min(8, math.ceil(3 * self.l2_bytes / max(bytes_per_set, 1))))

    def time_ms(self, fn: Fn, torch_side: bool = False) -> float:
        """Median ms per call: batches of back-to-back calls between CUDA events."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        est = max(time.perf_counter() - t0, 1e-6)
        k = max(1, min(200, int(3e-3 / est)))
        times = []
        for _ in range(self.trials):
            if torch_side:
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(k):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / k)
            else:
                s, e = self.cp.cuda.Event(), self.cp.cuda.Event()
                s.record()
                for _ in range(k):
                    fn()
                e.record()
                e.synchronize()
                times.append(self.cp.cuda.get_elapsed_time(s, e) / k)
        return float(statistics.median(times))

    def rel_err(self, ours: Any, ref: Any) -> float:
        """||ours - ref|| / ||ref|| of two torch tensors (float32 arithmetic: the logits' gradients are
        gigabytes, and the ratio is reported, not tested)."""
        a, b = ours.float(), ref.float()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    def to_torch(self, a: Any, like: Any) -> Any:
        """Copy a contiguous CuPy array into a new torch tensor of ``like``'s dtype (a raw device copy,
        so it needs no CuPy kernel for bfloat16)."""
        cp = self.cp
        assert a.flags.c_contiguous and a.dtype.itemsize == like.element_size()
        out = self.torch.empty(tuple(a.shape), dtype=like.dtype, device="cuda")
        cp.cuda.runtime.memcpyAsync(out.data_ptr(), a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)
        return out

    # ------------------------------------------------------------------------------------- ceilings

    def measure_ceilings(self) -> None:
        torch = self.torch
        n = 2**28  # 1 GiB of float32
        self.ceilings["copy_GBps"] = 2 * n * 4 / self.copy_ms(n) / 1e6
        self.free()
        m = 8192
        for name, dt in (("gemm_fp32_TFLOPs", torch.float32), ("gemm_bf16_TFLOPs", torch.bfloat16)):
            self.ceilings[name] = 2 * m**3 / self.gemm_ms(m, dt) / 1e9
            self.free()

    def copy_ms(self, n: int) -> float:
        a = self.torch.rand(n, device="cuda")
        b = self.torch.empty_like(a)
        return self.time_ms(lambda: b.copy_(a), torch_side=True)

    def gemm_ms(self, m: int, dt: Any) -> float:
        x = self.torch.randn(m, m, device="cuda", dtype=dt)
        y = self.torch.randn(m, m, device="cuda", dtype=dt)
        return self.time_ms(lambda: x @ y, torch_side=True)

    def mem_row(self, row: Row, nbytes: float) -> None:
        if row.ours_ms:
            row.rate = nbytes / row.ours_ms / 1e6
            row.unit = "GB/s"
            row.pct_ceiling = 100 * row.rate / self.ceilings["copy_GBps"]

    def flop_row(self, row: Row, flops: float, bf16: bool) -> None:
        if row.ours_ms:
            row.rate = flops / row.ours_ms / 1e9
            row.unit = "TFLOP/s"
            ceiling = self.ceilings["gemm_bf16_TFLOPs" if bf16 else "gemm_fp32_TFLOPs"]
            row.pct_ceiling = 100 * row.rate / ceiling

    # ------------------------------------------------------------------------------------- cases
    # Each family lists its shapes; each *_case method builds one case's data and closures (so that no
    # closure captures a loop variable) and appends its rows.

    def rotation(self, pool: list[Any]) -> Callable[[], Any]:
        """A function returning the next input set of ``pool`` on each call."""
        state = {"i": 0}

        def nxt() -> Any:
            state["i"] = (state["i"] + 1) % len(pool)
            return pool[state["i"]]

        return nxt

    def attention(self, rows: list[Row]) -> None:
        torch = self.torch
        shapes = [(1, 12, 64, 1024), (4, 12, 64, 1024), (8, 16, 64, 1024), (16, 12, 64, 1024), (1, 16, 64, 2048),
                  (1, 32, 128, 2048), (4, 32, 128, 2048), (1, 12, 64, 512)]
        if self.quick:
            shapes = [(16, 12, 64, 1024)]
        for B, H, D, T in shapes:
            for dt in (torch.float32, torch.bfloat16):
                for causal in (True, False):
                    self.attention_case(rows, B, H, D, T, dt, causal)
                    self.free()
                    self.attention_packed_case(rows, B, H, D, T, dt, causal)
                    self.free()

    def attention_case(self, rows: list[Row], B: int, H: int, D: int, T: int, dt: Any, causal: bool) -> None:
        import torch.nn.functional as F

        from blutrain.kernels import cuda as K

        torch = self.torch
        shape = f"{B}x{H}x{D} T={T}{' causal' if causal else ''}"
        dname = "fp32" if dt == torch.float32 else "bf16"
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=dt) for _ in range(4))
        cq, ck, cv, cdo = (self.as_cupy(t) for t in (q, k, v, do))
        scale = D**-0.5
        flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
        fwd = Row("attention fwd", shape, dname)
        res = K.sdpa(cq, ck, cv, None, causal, scale)
        assert res is not None
        out, lse = res
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fwd.rel_err = self.rel_err(self.to_torch(out, ref), ref)
        fwd.ours_ms = self.time_ms(lambda: K.sdpa(cq, ck, cv, None, causal, scale))
        fwd.torch_ms = self.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch_side=True)
        self.flop_row(fwd, flops, dt == torch.bfloat16)
        rows.append(fwd)
        bwd = Row("attention bwd", shape, dname)
        grads = K.sdpa_backward(cdo, cq, ck, cv, out, lse, None, causal, scale)
        assert grads is not None
        qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        tq, _, _ = torch.autograd.grad(o, (qr, kr, vr), do, retain_graph=True)
        bwd.rel_err = self.rel_err(self.to_torch(grads[0], tq), tq)
        bwd.ours_ms = self.time_ms(lambda: K.sdpa_backward(cdo, cq, ck, cv, out, lse, None, causal, scale))
        bwd.torch_ms = self.time_ms(lambda: torch.autograd.grad(o, (qr, kr, vr), do, retain_graph=True),
                                    torch_side=True)
        self.flop_row(bwd, 2.5 * flops, dt == torch.bfloat16)
        rows.append(bwd)

    def attention_packed_case(self, rows: list[Row], B: int, H: int, D: int, T: int, dt: Any, causal: bool) -> None:
        """GPT-2's layout: q, k, v read in place from one [B, T, 3C] projection, y written as [B, T, C] and the
        gradient as one [B, T, 3C] buffer, against PyTorch's attention on the same transposed views (its
        flash kernel takes them as they are) with the heads merged back."""
        import torch.nn.functional as F

        from blutrain.kernels import cuda as K

        torch = self.torch
        C = H * D
        shape = f"{B}x{H}x{D} T={T}{' causal' if causal else ''} packed"
        dname = "fp32" if dt == torch.float32 else "bf16"
        qkv, dy = torch.randn(B, T, 3 * C, device="cuda", dtype=dt), torch.randn(B, T, C, device="cuda", dtype=dt)
        cqkv, cdy = self.as_cupy(qkv), self.as_cupy(dy)
        scale = D**-0.5
        flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)

        def torch_fwd(x: Any) -> Any:
            q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in x.split(C, dim=2))
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, T, C)

        fwd = Row("attention fwd", shape, dname)
        res = K.sdpa_packed(cqkv, H, causal, scale)
        assert res is not None
        y, lse = res
        ref = torch_fwd(qkv)
        fwd.rel_err = self.rel_err(self.to_torch(y, ref), ref)
        fwd.ours_ms = self.time_ms(lambda: K.sdpa_packed(cqkv, H, causal, scale))
        fwd.torch_ms = self.time_ms(lambda: torch_fwd(qkv), torch_side=True)
        self.flop_row(fwd, flops, dt == torch.bfloat16)
        rows.append(fwd)
        bwd = Row("attention bwd", shape, dname)
        dqkv = K.sdpa_packed_backward(cdy, cqkv, y, lse, H, causal, scale)
        assert dqkv is not None
        xr = qkv.detach().requires_grad_(True)
        o = torch_fwd(xr)
        (tg,) = torch.autograd.grad(o, (xr,), dy, retain_graph=True)
        bwd.rel_err = self.rel_err(self.to_torch(dqkv, tg), tg)
        bwd.ours_ms = self.time_ms(lambda: K.sdpa_packed_backward(cdy, cqkv, y, lse, H, causal, scale))
        bwd.torch_ms = self.time_ms(lambda: torch.autograd.grad(o, (xr,), dy, retain_graph=True), torch_side=True)
        self.flop_row(bwd, 2.5 * flops, dt == torch.bfloat16)
        rows.append(bwd)

    def gelu(self, rows: list[Row]) -> None:
        torch = self.torch
        shapes = [(1, 1024, 3072), (4, 1024, 3072), (16, 1024, 3072), (16, 1024, 4096), (32, 1024, 3072),
                  (16, 1024, 16384), (1, 2048, 3072), (16, 2048, 3072)]
        if self.quick:
            shapes = [(16, 1024, 3072)]
        for shp in shapes:
            for dt in (torch.float32, torch.bfloat16):
                self.gelu_case(rows, shp, dt)
                self.free()

    def gelu_case(self, rows: list[Row], shp: tuple[int, ...], dt: Any) -> None:
        from blutrain.kernels import cuda as K

        torch = self.torch
        n = math.prod(shp)
        es = 4 if dt == torch.float32 else 2
        sets = [(torch.randn(*shp, device="cuda", dtype=dt), torch.randn(*shp, device="cuda", dtype=dt))
                for _ in range(self.copies(2 * n * es))]
        csets = [(self.as_cupy(x), self.as_cupy(g)) for x, g in sets]
        ours_next, torch_next = self.rotation(csets), self.rotation(sets)
        dname = "fp32" if dt == torch.float32 else "bf16"
        s = "x".join(map(str, shp))
        x0, g0 = sets[0]
        fwd = Row("gelu_tanh fwd", s, dname)
        fwd.rel_err = self.rel_err(self.to_torch(K.gelu(csets[0][0], "tanh"), x0),
                                   torch.nn.functional.gelu(x0, approximate="tanh"))
        fwd.ours_ms = self.time_ms(lambda: K.gelu(ours_next()[0], "tanh"))
        fwd.torch_ms = self.time_ms(lambda: torch.nn.functional.gelu(torch_next()[0], approximate="tanh"),
                                    torch_side=True)
        self.mem_row(fwd, 2 * n * es)
        rows.append(fwd)
        bwd = Row("gelu_tanh bwd", s, dname)
        ref = torch.ops.aten.gelu_backward(g0, x0, approximate="tanh")
        bwd.rel_err = self.rel_err(self.to_torch(K.gelu_backward(csets[0][1], csets[0][0], "tanh"), x0), ref)

        def ours_bwd() -> Any:
            x, g = ours_next()
            return K.gelu_backward(g, x, "tanh")

        def torch_bwd() -> Any:
            x, g = torch_next()
            return torch.ops.aten.gelu_backward(g, x, approximate="tanh")

        bwd.ours_ms = self.time_ms(ours_bwd)
        bwd.torch_ms = self.time_ms(torch_bwd, torch_side=True)
        self.mem_row(bwd, 3 * n * es)
        rows.append(bwd)

    def casts(self, rows: list[Row]) -> None:
        torch = self.torch
        shapes = [(16384, 768), (16384, 2304), (16384, 3072), (16, 1024, 50304)]
        if self.quick:
            shapes = [(16384, 768)]
        f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
        pairs = [(f32, bf16), (bf16, f32), (f32, f16), (f16, f32), (bf16, f16), (f16, bf16)]
        for shp in shapes:
            for src, dst in pairs:
                self.cast_case(rows, shp, src, dst)
                self.free()

    def cast_case(self, rows: list[Row], shp: tuple[int, ...], src: Any, dst: Any) -> None:
        """One dtype conversion: ours (casts.cu), torch's ``.to(dtype)`` and, in the row's extra, CuPy's astype
        (what the cuda backend ran before); bytes read + written."""
        import ml_dtypes
        import numpy as np

        from blutrain.kernels import cuda as K

        torch = self.torch
        n = math.prod(shp)
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        target = {torch.float32: np.dtype(np.float32), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                  torch.float16: np.dtype(np.float16)}[dst]
        es_in, es_out = (torch.empty((), dtype=d).element_size() for d in (src, dst))
        sets = [(torch.randn(*shp, device="cuda") * 4).to(src) for _ in range(self.copies(n * es_in))]
        csets = [self.as_cupy(t) for t in sets]
        ours_next, torch_next = self.rotation(csets), self.rotation(sets)
        row = Row(f"cast {names[src]}->{names[dst]}", "x".join(map(str, shp)), names[src])
        ref = sets[0].to(dst)
        ours = K.cast(csets[0], target)
        assert ours is not None
        got = self.to_torch(ours, ref)
        bits = torch.int16 if es_out == 2 else torch.int32
        row.rel_err = self.rel_err(got, ref)
        row.extra["elements_differing_from_torch"] = int((got.view(bits) != ref.view(bits)).sum())
        del ours, got, ref
        row.ours_ms = self.time_ms(lambda: K.cast(ours_next(), target))
        row.torch_ms = self.time_ms(lambda: torch_next().to(dst), torch_side=True)
        row.extra["cupy_astype_ms"] = self.time_ms(lambda: ours_next().astype(target))
        self.mem_row(row, n * (es_in + es_out))
        if row.rate and row.ours_ms:
            row.extra["cupy_astype_GBps"] = row.rate * row.ours_ms / row.extra["cupy_astype_ms"]
        rows.append(row)

    def layernorm(self, rows: list[Row]) -> None:
        torch = self.torch
        shapes = [(1024, 768), (4096, 768), (16384, 768), (32768, 768), (16384, 1024), (16384, 3072), (16384, 4096)]
        if self.quick:
            shapes = [(16384, 768)]
        for N, C in shapes:
            for dt in (torch.float32, torch.bfloat16):
                self.layernorm_case(rows, N, C, dt)
                self.free()

    def layernorm_case(self, rows: list[Row], N: int, C: int, dt: Any) -> None:
        from blutrain.kernels import cuda as K

        torch = self.torch
        es = 4 if dt == torch.float32 else 2
        w = torch.randn(C, device="cuda", dtype=dt)
        b = torch.randn(C, device="cuda", dtype=dt)
        cw, cb = self.as_cupy(w), self.as_cupy(b)
        sets = []
        for _ in range(self.copies(2 * N * C * es)):
            x, g = torch.randn(N, C, device="cuda", dtype=dt), torch.randn(N, C, device="cuda", dtype=dt)
            cx, cg = self.as_cupy(x), self.as_cupy(g)
            ours_stats = K.layer_norm(cx, cw, cb, 1e-5, 1)
            assert ours_stats is not None
            sets.append((x, g, cx, cg, ours_stats, torch.ops.aten.native_layer_norm(x, [C], w, b, 1e-5)))
        nxt = self.rotation(sets)
        dname = "fp32" if dt == torch.float32 else "bf16"
        fwd = Row("layernorm fwd", f"{N}x{C}", dname)
        fwd.rel_err = self.rel_err(self.to_torch(sets[0][4][0], w), sets[0][5][0])
        fwd.ours_ms = self.time_ms(lambda: K.layer_norm(nxt()[2], cw, cb, 1e-5, 1))
        fwd.torch_ms = self.time_ms(lambda: torch.ops.aten.native_layer_norm(nxt()[0], [C], w, b, 1e-5),
                                    torch_side=True)
        self.mem_row(fwd, 2 * N * C * es)
        rows.append(fwd)

        def ours_bwd(case: Any = None) -> Any:
            _, _, cx, cg, st, _ = case if case is not None else nxt()
            return K.layer_norm_backward(cg, cx, cw, st[1], st[2], 1, True, True)

        def torch_bwd(case: Any = None) -> Any:
            x, g, _, _, _, (_, mean, rstd) = case if case is not None else nxt()
            return torch.ops.aten.native_layer_norm_backward(g, x, [C], mean, rstd, w, b, [True, True, True])

        bwd = Row("layernorm bwd", f"{N}x{C}", dname)
        ours, ref = ours_bwd(sets[0]), torch_bwd(sets[0])
        assert ours is not None
        bwd.rel_err = self.rel_err(self.to_torch(ours[0], w), ref[0])
        bwd.extra["dweight_err"] = self.rel_err(self.to_torch(ours[1], w), ref[1])
        bwd.ours_ms = self.time_ms(ours_bwd)
        bwd.torch_ms = self.time_ms(torch_bwd, torch_side=True)
        self.mem_row(bwd, 3 * N * C * es)
        rows.append(bwd)

    def cross_entropy(self, rows: list[Row]) -> None:
        shapes = [(1024, 50304, "fp32"), (4096, 50304, "fp32"), (8192, 50304, "fp32"), (16384, 50304, "fp32"),
                  (32768, 50304, "fp32"), (16384, 32000, "fp32"), (16384, 128256, "fp32"), (16384, 50304, "bf16"),
                  (16384, 128256, "bf16")]
        if self.quick:
            shapes = [(16384, 50304, "fp32"), (16384, 50304, "bf16")]
        for N, V, dname in shapes:
            self.cross_entropy_case(rows, N, V, dname)
            self.free()

    def cross_entropy_case(self, rows: list[Row], N: int, V: int, dname: str) -> None:
        import torch.nn.functional as F

        from blutrain.kernels import cuda as K

        torch = self.torch
        dt = torch.float32 if dname == "fp32" else torch.bfloat16
        es = 4 if dname == "fp32" else 2
        logits = torch.randn(N, V, device="cuda", dtype=dt) * 2
        target = torch.randint(0, V, (N,), device="cuda")
        cl, ct = self.as_cupy(logits), self.as_cupy(target)
        fwd = Row("cross_entropy fwd", f"{N}x{V}", dname)
        res = K.cross_entropy(cl, ct, -100, 0.0, "mean")
        assert res is not None
        loss, lse = res
        fwd.rel_err = self.rel_err(self.to_torch(loss, logits), F.cross_entropy(logits.float(), target))
        fwd.ours_ms = self.time_ms(lambda: K.cross_entropy(cl, ct, -100, 0.0, "mean"))
        fwd.torch_ms = self.time_ms(lambda: F.cross_entropy(logits, target), torch_side=True)
        self.mem_row(fwd, N * V * es)
        rows.append(fwd)
        bwd = Row("cross_entropy bwd", f"{N}x{V}", dname)
        one = self.as_cupy(torch.ones((), device="cuda", dtype=dt))
        lr = logits.detach().requires_grad_(True)
        tl = F.cross_entropy(lr, target)
        (tg,) = torch.autograd.grad(tl, lr, retain_graph=True)
        ours_g = K.cross_entropy_backward(one, cl, ct, lse, -100, 0.0, "mean")
        bwd.rel_err = self.rel_err(self.to_torch(ours_g, logits), tg)
        del ours_g, tg
        bwd.ours_ms = self.time_ms(lambda: K.cross_entropy_backward(one, cl, ct, lse, -100, 0.0, "mean"))
        bwd.torch_ms = self.time_ms(lambda: torch.autograd.grad(tl, lr, retain_graph=True), torch_side=True)
        self.mem_row(bwd, 2 * N * V * es)
        rows.append(bwd)
        tl = None  # drop torch's saved graph (a softmax-sized tensor) before the fused timing
        self.free()
        fused = Row("cross_entropy fwd+bwd fused", f"{N}x{V}", dname, note="torch: forward then backward")

        def torch_both() -> Any:
            return torch.autograd.grad(F.cross_entropy(lr, target), lr)

        fused.ours_ms = self.time_ms(lambda: K.cross_entropy_with_grad(cl, ct, -100, 0.0, "mean"))
        fused.torch_ms = self.time_ms(torch_both, torch_side=True)
        self.mem_row(fused, 2 * N * V * es)
        rows.append(fused)

    def reduce_sum(self, rows: list[Row]) -> None:
        torch = self.torch
        shapes = [(1024, 768), (4096, 768), (16384, 768), (32768, 768), (16384, 3072), (16384, 4096), (16384, 50304)]
        if self.quick:
            shapes = [(16384, 768)]
        for N, D in shapes:
            for dt in (torch.float32, torch.bfloat16):
                self.reduce_sum_case(rows, N, D, dt)
                self.free()

    def reduce_sum_case(self, rows: list[Row], N: int, D: int, dt: Any) -> None:
        from blutrain.kernels import cuda as K

        torch = self.torch
        es = 4 if dt == torch.float32 else 2
        sets = [torch.randn(N, D, device="cuda", dtype=dt) for _ in range(self.copies(N * D * es))]
        csets = [self.as_cupy(x) for x in sets]
        ours_next, torch_next = self.rotation(csets), self.rotation(sets)
        row = Row("sum over rows (N x D -> D)", f"{N}x{D}", "fp32" if dt == torch.float32 else "bf16")
        row.rel_err = self.rel_err(self.to_torch(K.sum_cols(csets[0]), sets[0][0]), sets[0].double().sum(0))
        row.ours_ms = self.time_ms(lambda: K.sum_cols(ours_next()))
        row.torch_ms = self.time_ms(lambda: torch_next().sum(0), torch_side=True)
        self.mem_row(row, N * D * es)
        rows.append(row)

    def adamw(self, rows: list[Row]) -> None:
        block = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,),
                 (3072, 768), (768,)]
        gpt2 = [(50304, 768), (1024, 768), *(block * 12), (768,), (768,)]
        sets: dict[str, list[tuple[int, ...]]] = {"ln weight": [(768,)], "c_attn weight": [(768, 2304)],
                                                  "wte": [(50304, 768)], "gpt2 block": block, "gpt2 124M": gpt2}
        if self.quick:
            sets = {"gpt2 124M": gpt2}
        for name, shapes in sets.items():
            for clip in (None, 1.0):
                self.adamw_case(rows, name, shapes, clip)
                self.free()

    def adamw_case(self, rows: list[Row], name: str, shapes: list[tuple[int, ...]], clip: float | None) -> None:
        from blutrain.kernels import cuda as K
        from blutrain.optim import StepScalars
        from blutrain.tensor import device

        torch = self.torch
        params = [torch.randn(*s, device="cuda") * 0.02 for s in shapes]
        grads = [torch.randn(*s, device="cuda") * 1e-3 for s in shapes]
        m = [torch.zeros(*s, device="cuda") for s in shapes]
        v = [torch.zeros(*s, device="cuda") for s in shapes]
        cp_, cg, cm, cv = ([self.as_cupy(t) for t in ts] for ts in (params, grads, m, v))
        tparams = [p.clone().requires_grad_(True) for p in params]
        for p, g in zip(tparams, grads, strict=True):
            p.grad = g.clone()
        opt = torch.optim.AdamW(tparams, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        step = {"n": 0}
        scalars, cuda0 = StepScalars(), device("cuda")

        def ours() -> Any:  # what AdamW.step does: refill the step's scalars, then one (two with clip) launch
            step["n"] += 1
            n = step["n"]
            lr_bc = scalars("adamw", cuda0, (1e-4, 1.0 - 0.9**n, math.sqrt(1.0 - 0.95**n)))
            return K.adamw_multi_tensor(cp_, cg, cm, cv, lr_bc, 0.9, 0.95, 1e-8, 0.1, max_grad_norm=clip)

        def theirs() -> Any:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(tparams, clip, foreach=True)
            opt.step()

        ours()  # one step from the same state on both sides, for the error column
        theirs()
        err = max(self.rel_err(a, b.detach()) for a, b in zip(params, tparams, strict=True))
        n = sum(math.prod(s) for s in shapes)
        row = Row("adamw" + (" + clip" if clip else ""), f"{name} ({n / 1e6:.2f}M)", "fp32")
        row.rel_err = err
        row.ours_ms = self.time_ms(ours)
        row.torch_ms = self.time_ms(theirs, torch_side=True)
        row.note = "torch: fused AdamW" + (" + foreach clip_grad_norm_" if clip else "")
        self.mem_row(row, n * (32 if clip else 28))
        rows.append(row)

    # GPT-2 124M's linear layers at 16 x 1024 tokens (C = 768): (label, layout, M, N, K, accumulate). Layouts
    # are gemm_3xtf32's flags: "nt" forward x Wᵀ, "nn" input gradient dy W, "tn" weight gradient dyᵀ x. The
    # LM head runs in chunks of 1334 rows (256 MiB of float32 logits), its weight gradient accumulated.
    GEMM_SHAPES: tuple[tuple[str, str, int, int, int, bool], ...] = (
        ("attn qkv fwd", "nt", 16384, 2304, 768, False), ("attn proj fwd", "nt", 16384, 768, 768, False),
        ("mlp fc fwd", "nt", 16384, 3072, 768, False), ("mlp proj fwd", "nt", 16384, 768, 3072, False),
        ("attn qkv dx", "nn", 16384, 768, 2304, False), ("attn proj dx", "nn", 16384, 768, 768, False),
        ("mlp fc dx", "nn", 16384, 768, 3072, False), ("mlp proj dx", "nn", 16384, 3072, 768, False),
        ("attn qkv dW", "tn", 2304, 768, 16384, False), ("attn proj dW", "tn", 768, 768, 16384, False),
        ("mlp fc dW", "tn", 3072, 768, 16384, False), ("mlp proj dW", "tn", 768, 3072, 16384, False),
        ("lm head chunk fwd", "nt", 1334, 50304, 768, False), ("lm head chunk dx", "nn", 1334, 768, 50304, False),
        ("lm head chunk dW", "tn", 50304, 768, 1334, True),
    )

    def gemm(self, rows: list[Row]) -> None:
        shapes = self.GEMM_SHAPES
        if self.quick:
            shapes = (shapes[0], shapes[4], shapes[8])  # one of each layout
        for case in shapes:
            self.gemm_case(rows, *case)
            self.free()

    def gemm_case(self, rows: list[Row], label: str, layout: str, M: int, N: int, K: int, accumulate: bool) -> None:
        """3xTF32 (gemm_3xtf32) against torch.matmul in strict float32 (TF32 off), both against a float64
        product of the same operands; torch's time, TFLOP/s and error go in the row's extra."""
        from blutrain.kernels import cuda as K_

        torch = self.torch
        assert not torch.backends.cuda.matmul.allow_tf32
        trans_a, trans_b = layout[0] == "t", layout[1] == "t"
        a = torch.randn(*((K, M) if trans_a else (M, K)), device="cuda")
        b = torch.randn(*((N, K) if trans_b else (K, N)), device="cuda")
        c0 = torch.randn(M, N, device="cuda") if accumulate else None
        opa, opb = (a.t() if trans_a else a), (b.t() if trans_b else b)
        ref = opa.double() @ opb.double()
        if c0 is not None:
            ref += c0.double()
        ours_out = c0.clone() if c0 is not None else torch.empty(M, N, device="cuda")
        theirs_out = c0.clone() if c0 is not None else torch.empty(M, N, device="cuda")
        ca, cb, co = self.as_cupy(a), self.as_cupy(b), self.as_cupy(ours_out)

        def ours() -> Any:
            return K_.gemm_3xtf32(ca, cb, co, trans_a, trans_b, accumulate)

        def theirs() -> Any:
            if accumulate:
                return theirs_out.addmm_(opa, opb)
            return torch.matmul(opa, opb, out=theirs_out)

        assert ours(), f"gemm_3xtf32 declined {layout} {M}x{N}x{K}"
        theirs()
        row = Row(f"gemm 3xtf32 {layout}" + (" +=" if accumulate else ""), f"{M}x{N}x{K} {label}", "fp32",
                  note="torch: matmul, fp32 strict (TF32 off)")
        row.rel_err = float((ours_out.double() - ref).norm() / ref.norm())
        row.extra["torch_rel_err"] = float((theirs_out.double() - ref).norm() / ref.norm())
        del ref
        row.ours_ms = self.time_ms(ours)
        row.torch_ms = self.time_ms(theirs, torch_side=True)
        flops = 2.0 * M * N * K
        self.flop_row(row, flops, False)
        row.extra["torch_TFLOPs"] = flops / row.torch_ms / 1e9
        print(f"  gemm {layout} {M}x{N}x{K} ({label}): ours {row.rate:.1f} TFLOP/s, rel.err {row.rel_err:.1e}; "
              f"torch fp32 {row.extra['torch_TFLOPs']:.1f} TFLOP/s, rel.err {row.extra['torch_rel_err']:.1e}; "
              f"ours/torch time {row.ratio:.2f}", flush=True)
        rows.append(row)


FAMILIES = ("attention", "gelu", "layernorm", "cross_entropy", "reduce_sum", "adamw", "casts", "gemm")


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[Row]) -> str:
    head = f"{'op':<30} {'shape':<26} {'dtype':<5} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} " \
           f"{'rate':>14} {'%ceil':>6} {'rel.err':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = "-" if r.rate is None else f"{r.rate:,.1f} {r.unit}"
        lines.append(f"{r.op:<30} {r.shape:<26} {r.dtype:<5} {fmt(r.ours_ms, '9.4f')} {fmt(r.torch_ms, '9.4f')} "
                     f"{fmt(r.ratio, '10.2f')} {rate:>14} {fmt(r.pct_ceiling, '6.1f')} {fmt(r.rel_err, '8.1e')}"
                     + (f"  {r.note}" if r.note.startswith("ERROR") else ""))
    return "\n".join(lines)


def summary(rows: list[Row], ceilings: dict[str, float], device: str) -> str:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(f"{r.op} {r.dtype}", []).append(r)
    lines = [f"device: {device}; ceilings: copy {ceilings.get('copy_GBps', 0):,.0f} GB/s, fp32 GEMM "
             f"{ceilings.get('gemm_fp32_TFLOPs', 0):.1f} TFLOP/s, bf16 GEMM {ceilings.get('gemm_bf16_TFLOPs', 0):.0f} "
             "TFLOP/s",
             f"{'kernel':<38} {'shapes':>6} {'faster':>6} {'geomean ours/torch':>18} {'worst':>7} {'best %ceil':>10} "
             f"{'max err':>8}"]
    for key, rs in groups.items():
        ratios = [r.ratio for r in rs if r.ratio is not None]
        errs = [r.rel_err for r in rs if r.rel_err is not None]
        pcts = [r.pct_ceiling for r in rs if r.pct_ceiling is not None]
        failed = sum(1 for r in rs if r.note.startswith("ERROR"))
        gm = math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None
        lines.append(f"{key:<38} {len(rs):>6} {sum(1 for x in ratios if x <= 1.0):>6} {fmt(gm, '18.2f')} "
                     f"{fmt(max(ratios) if ratios else None, '7.2f')} {fmt(max(pcts) if pcts else None, '10.1f')} "
                     f"{fmt(max(errs) if errs else None, '8.1e')}" + (f"  ({failed} failed)" if failed else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one shape per kernel")
    ap.add_argument("--out", default="bench_kernels.json", help="JSON output path")
    ap.add_argument("--summary", default=None, help="also write the summary table to this file")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}")
    args = ap.parse_args(argv)

    bench = Bench(args.quick)
    torch = bench.torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    t0 = time.perf_counter()
    bench.measure_ceilings()
    print(f"ceilings on {bench.device_name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in bench.ceilings.items()),
          flush=True)
    rows: list[Row] = []
    for family in args.only.split(","):
        family = family.strip()
        if family not in FAMILIES:
            print(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
            return 2
        start = len(rows)
        try:
            getattr(bench, family)(rows)
        except Exception as exc:  # a failing kernel family must not hide the others' numbers
            traceback.print_exc()
            rows.append(Row(family, "-", "-", note=f"ERROR {type(exc).__name__}: {exc}"[:300]))
            bench.free()
        print(f"[{family}: {len(rows) - start} rows, {time.perf_counter() - t0:.0f} s]", flush=True)
    report = {"device": bench.device_name, "ceilings": bench.ceilings, "quick": args.quick,
              "rows": [dict(asdict(r), ratio=r.ratio) for r in rows]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(table(rows))
    print()
    text = summary(rows, bench.ceilings, bench.device_name)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
