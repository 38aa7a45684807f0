"""GPU memory: a step that runs out of memory is reported with the allocator's summary, and
``--auto-batch`` finds the largest micro-batch that fits, keeping the global batch by accumulation.

The CPU backend allocates through NumPy, so these tests give each step a real memory budget: a
``blutrain.alloc.CachingAllocator`` over a ``HostProvider`` with a byte limit, from which every
micro-batch allocates its activation bytes for the duration of its forward and backward. The
allocator raises ``OutOfMemoryError`` exactly as it does on cuda (after emptying its cache and
retrying once)."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest

import blutrain.tensor as bt
from blutrain.alloc import CachingAllocator, HostProvider
from blutrain.train import TrainConfig, TrainError, TrainOutOfMemoryError
from blutrain.train.trainer import Trainer, smaller_micro_batch

MakeConfig = Callable[..., TrainConfig]
MiB = 1 << 20


class _BudgetedTrainer(Trainer):
    """Each micro-batch of B sequences holds ``B × bytes_per_sequence`` of a limited allocator while it runs."""

    bytes_per_sequence = 4 * MiB
    limit = 20 * MiB

    def __init__(self, cfg: TrainConfig) -> None:
        self.allocator = CachingAllocator(HostProvider(limit=self.limit))
        super().__init__(cfg, stream=io.StringIO())

    def _accumulate(self, batches: list[tuple[bt.Tensor, bt.Tensor]]) -> list[bt.Tensor]:
        blocks = [self.allocator.malloc(x.shape[0] * self.bytes_per_sequence) for x, _ in batches[:1]]
        try:
            return super()._accumulate(batches)
        finally:
            for ptr in blocks:
                self.allocator.free(ptr)


def _losses(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.train_step()["loss"] for _ in range(steps)]


def test_next_micro_batch_is_the_largest_divisor_at_most_half() -> None:
    assert [smaller_micro_batch(16, m) for m in (16, 8, 4, 2, 1)] == [8, 4, 2, 1, 0]
    assert [smaller_micro_batch(12, m) for m in (12, 6, 3)] == [6, 3, 1]
    assert smaller_micro_batch(7, 7) == 1


def test_auto_batch_halves_until_the_step_fits_and_keeps_the_global_batch(make_config: MakeConfig) -> None:
    # global batch 16 sequences: 16 × 4 MiB and 8 × 4 MiB exceed the 20 MiB limit, 4 × 4 MiB fits
    trainer = _BudgetedTrainer(make_config(batch_size=16, auto_batch=True))
    losses = _losses(trainer, 2)  # before another trainer reseeds the process's generator
    assert (trainer.cfg.batch_size, trainer.cfg.grad_accum_steps) == (4, 4)
    assert trainer.cfg.total_batch_tokens == 16 * 16
    report = trainer.stream.getvalue()  # type: ignore[attr-defined]
    assert "auto-batch: micro-batch 4 × 16 tokens fits; 4 micro-batch(es) per step keep the global batch at 16" \
        in report
    assert "micro-batch 16: out of memory: tried to allocate 64.00 MiB" in report
    assert "micro-batch 8: out of memory: tried to allocate 32.00 MiB" in report
    # the probes left no trace: training equals a run configured with that micro-batch from the start
    direct = Trainer(make_config(batch_size=4, total_batch_tokens=16 * 16), stream=io.StringIO())
    assert losses == _losses(direct, 2)
    assert trainer.allocator.stats().allocated_bytes == 0


def test_auto_batch_keeps_a_micro_batch_that_fits_and_changes_nothing(make_config: MakeConfig) -> None:
    auto = Trainer(make_config(auto_batch=True), stream=io.StringIO())
    assert auto.cfg.batch_size == 4 and auto.cfg.grad_accum_steps == 1
    losses = _losses(auto, 3)
    assert losses == _losses(Trainer(make_config(), stream=io.StringIO()), 3)


def test_auto_batch_reports_when_not_even_one_sequence_fits(make_config: MakeConfig) -> None:
    class Tight(_BudgetedTrainer):
        limit = 2 * MiB

    with pytest.raises(TrainOutOfMemoryError, match=r"even a micro-batch of 1 × 16 tokens runs out of memory on cpu: "
                                                    r"out of memory: tried to allocate 4\.00 MiB"):
        Tight(make_config(batch_size=4, auto_batch=True))


def test_a_step_out_of_memory_is_reported_with_the_allocator_summary(make_config: MakeConfig) -> None:
    trainer = _BudgetedTrainer(make_config(batch_size=8))  # 8 × 4 MiB > 20 MiB
    with pytest.raises(TrainOutOfMemoryError) as info:
        trainer.train_step()
    message = str(info.value)
    assert message.startswith("step 1: out of memory with a micro-batch of 8 × 16 tokens on cpu")
    assert "the provider has 20.00 MiB free of 20.00 MiB" in message and "largest free block" in message
    assert "--auto-batch" in message
    assert isinstance(info.value, TrainError) and info.value.micro_batch == 8 and info.value.step == 1


def test_auto_batch_cannot_size_a_compiled_step(make_config: MakeConfig) -> None:
    from blutrain.train import ConfigError

    with pytest.raises(ConfigError, match=r"auto_batch cannot size compile's graph"):
        Trainer(make_config(compile=True, auto_batch=True))
