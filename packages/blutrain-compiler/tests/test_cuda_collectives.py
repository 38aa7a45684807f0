"""The CUDA executor's collectives (:class:`~blutrain.compiler.executor.StreamCollectives`) on one GPU: work
handed to the capture, as a collective of a ``traceable`` group is, runs on a side stream inside the one captured
graph, and the launches after it see its result. (Several GPUs with NCCL: integration_tests/
test_dist_compile_cuda.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.compiler as bc
import blutrain.tensor as bt
from blutrain.autograd import no_grad
from blutrain.compiler.executor import CUDAGraphExecutor, StreamCollectives
from blutrain.tensor import capture

pytestmark = pytest.mark.cuda


def _cuda() -> None:
    registry = bt.backends()
    if "cuda" not in registry.names() or not registry.get("cuda").is_available():
        pytest.skip("no CUDA device")


def _scale(t: bt.Tensor, factor: float) -> None:
    with no_grad():
        t.mul_(factor)


def scale_outside_kernels(t: bt.Tensor, factor: float) -> None:
    found = capture.active()
    if found is None:
        _scale(t, factor)
    else:
        found.host_call("scale", _scale, (t, factor))


def test_work_handed_to_the_capture_runs_inside_the_graph_and_is_joined_before_its_reader() -> None:
    _cuda()
    acc = bt.zeros(1 << 20, device="cuda")

    def f(x: bt.Tensor) -> bt.Tensor:
        y = x * 2.0
        z = (x + 1.0) * 3.0  # beside the collective
        scale_outside_kernels(y, 3.0)  # a large buffer, so the reader below would see a stale one if not joined
        acc.add_(z)
        return y + z

    fn = bc.compile(f)
    rng = np.random.default_rng(0)
    want_acc = np.zeros(1 << 20, np.float32)
    for _ in range(5):
        x = rng.standard_normal(1 << 20).astype(np.float32)
        got = fn(bt.tensor(x, device="cuda")).cpu().numpy()
        z = (x + 1.0).astype(np.float32) * np.float32(3.0)
        want_acc += z
        np.testing.assert_allclose(got, x * 6.0 + z, rtol=1e-6)
    np.testing.assert_allclose(acc.cpu().numpy(), want_acc, rtol=1e-5)
    graph = fn.last
    assert graph is not None and isinstance(graph.executor, CUDAGraphExecutor)
    assert graph.executor.captures == 1 and not graph.executor.eager, graph.executor.capture_error
    assert isinstance(graph.program.runner, StreamCollectives) and not graph.program.runner.pending
    assert fn.stats.collectives == 1
