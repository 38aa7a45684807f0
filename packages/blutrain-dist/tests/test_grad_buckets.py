"""How replicas' gradients are grouped for averaging: reverse parameter order, one device and dtype per bucket,
a new bucket once the cap is reached."""

from __future__ import annotations

import blutrain.tensor as bt
from blutrain.dist import GradBucket, bucket_parameters


def _params(*specs: tuple[str, int, str]) -> list[tuple[str, bt.Tensor]]:
    return [(name, bt.zeros(n, dtype=dtype)) for name, n, dtype in specs]


def test_buckets_follow_backward_order_and_close_at_the_cap() -> None:
    params = _params(("a", 4, "float32"), ("b", 4, "float32"), ("c", 4, "float32"))
    buckets = bucket_parameters(params, cap_bytes=32)  # two float32 vectors of 4 fill a bucket
    assert [b.names for b in buckets] == [["c", "b"], ["a"]]
    assert [b.index for b in buckets] == [0, 1]


def test_each_bucket_holds_one_dtype() -> None:
    params = _params(("w", 2, "float32"), ("h", 2, "bfloat16"), ("v", 2, "float32"))
    buckets = bucket_parameters(params, cap_bytes=1 << 20)
    assert sorted(tuple(b.names) for b in buckets) == [("h",), ("v", "w")]
    assert all(len({p.dtype for p in b.params}) == 1 for b in buckets)


def test_a_fresh_bucket_waits_for_every_gradient() -> None:
    bucket = GradBucket(0, _params(("a", 3, "float32"), ("b", 3, "float32")))
    assert bucket.pending == 2 and bucket.ready == [False, False] and bucket.work is None
