"""Model FLOPs utilisation (MFU) and device memory for the progress line and metrics.jsonl.

MFU is the share of the devices' peak arithmetic rate that the model's own FLOPs use: FLOPs per token of
one training step (forward + backward, as the model family counts them: ``Model.flops_per_token``) × tokens
per second, over the peak of every device of the run. As in
the PaLM paper and nanoGPT, only the model's matrix multiplications count (recomputation, the optimizer,
norms and element-wise work do not), so MFU does not reward doing extra work. The peak is the vendor's dense
datasheet figure for the run's dtype; a device whose peak is not known here (the CPU, other GPUs) gets no
MFU rather than a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from blutrain.tensor.backend import Backend

# Dense (no sparsity) peak FLOP/s by --dtype, per device, from NVIDIA's datasheets (the same figures as
# tools/bench/gpt2.py); the first name that the device's name contains (case-blind) wins, so the more
# specific names come first. H100 SXM and H200 share the Hopper SXM figures.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIE", {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12}),
    ("H100 NVL", {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12}),
    ("H200", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12}),
    ("H100", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12}),
)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The device's dense peak FLOP/s for ``dtype`` (fp32, tf32, bf16), or None where it is not known."""
    name = device_name.upper()
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(dtype)
    return None


@dataclass
class Throughput:
    """What the trainer adds to each step's metrics: ``mfu`` where the peak is known, ``mem_peak_bytes``
    (the device's peak allocated memory so far) where the backend reports it."""

    flops_per_token: int
    peak_per_device: float | None
    devices: int
    backend: Backend
    index: int

    @classmethod
    def for_run(cls, flops_per_token: int, backend: Backend, index: int, dtype: str, devices: int) -> Throughput:
        """``flops_per_token``: the model's (``Model.flops_per_token``, which each family declares)."""
        return cls(flops_per_token, peak_flops(backend.device_name(index), dtype), devices, backend, index)

    def metrics(self, tokens_per_s: float) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        if self.peak_per_device:
            out["mfu"] = self.flops_per_token * tokens_per_s / (self.peak_per_device * self.devices)
        peak = self.backend.max_memory_allocated(self.index)
        if peak is not None:
            out["mem_peak_bytes"] = int(peak)
        return out


__all__ = ["PEAK_FLOPS", "Throughput", "peak_flops"]
