"""philox.cu's draws against the NumPy reference of philox_reference.py.
Skipped without an NVIDIA GPU and CuPy; helpers and tolerances: cuda_kernel_checks.py."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_kernel_checks import check

pytestmark = pytest.mark.cuda  # conftest: skipped without a GPU, run with poisoned device memory


def test_philox_kernel_matches_the_reference_words() -> None:
    from blutrain.kernels import cuda
    from blutrain.kernels.cuda import philox_reference as ref

    words, used = cuda.philox("raw", 1000, 0x1234_5678_9ABC, 2**32 - 3)  # the counter crosses 32 bits
    assert used == 1000
    got = np.asarray(__import__("cupy").asnumpy(words)).reshape(-1, 4)
    assert np.array_equal(got, ref.philox_words(0x1234_5678_9ABC, 2**32 - 3, 1000))
    first, _ = cuda.philox("raw", 1, 0, 0)
    _, _, expected = ref.KNOWN_ANSWERS[0]
    assert tuple(int(x) for x in __import__("cupy").asnumpy(first)) == expected


def test_philox_uniform_integers_and_normal_match_the_reference() -> None:
    import cupy as cp

    from blutrain.kernels import cuda
    from blutrain.kernels.cuda import philox_reference as ref

    u, used = cuda.philox("uniform_f32", 1001, 42, 17)
    assert used == 251
    assert np.array_equal(cp.asnumpy(u), ref.uniform_f32(42, 17, 1001))
    i, _ = cuda.philox("integers", 999, 42, 5, low=-7, high=1000)
    assert np.array_equal(cp.asnumpy(i), ref.integers(42, 5, 999, -7, 1000))
    z, _ = cuda.philox("normal_f32", 1003, 42, 9)
    check(z, ref.normal_f32(42, 9, 1003), np.float32, tol=1e-5)
    d, _ = cuda.philox("uniform_f64", 1001, 42, 9)
    got = cp.asnumpy(d)
    assert ((got >= 0) & (got < 1)).all() and abs(got.mean() - 0.5) < 0.05
