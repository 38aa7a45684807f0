"""The executor's arena: placement by liveness, and the recording and serving allocators on a fake device."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.compiler.arena import (
    ALIGN,
    Placement,
    RecordingRun,
    Request,
    ServingRun,
    aligned,
    live_peak,
    place,
)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _assert_sound(requests: list[Request], p: Placement) -> None:
    """No two requests live at the same time share a byte; every offset aligned; the arena holds them all."""
    n = len(requests)
    for i in range(n):
        assert p.offsets[i] % ALIGN == 0
        assert p.offsets[i] + p.sizes[i] <= p.nbytes
        for j in range(i + 1, n):
            if j < p.ends[i]:  # j starts while i is live
                assert not _overlap((p.offsets[i], p.offsets[i] + p.sizes[i]),
                                    (p.offsets[j], p.offsets[j] + p.sizes[j])), (i, j)


@st.composite
def _requests(draw: st.DrawFn, max_size: int = 40, one_size: bool = False) -> list[Request]:
    n = draw(st.integers(0, max_size))
    size = draw(st.integers(1, 16)) * ALIGN
    out = []
    for i in range(n):
        s = size if one_size else draw(st.integers(1, 64)) * ALIGN
        end = draw(st.one_of(st.none(), st.integers(i + 1, n)))
        out.append(Request(s, end))
    return out


# -- placement -----------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(_requests())
def test_placement_never_overlaps_two_live_requests_and_reaches_at_least_the_live_peak(requests: list[Request]) -> None:
    p = place(requests)
    _assert_sound(requests, p)
    assert p.nbytes >= p.live_peak == live_peak(requests)
    assert p.nbytes == max((o + s for o, s in zip(p.offsets, p.sizes, strict=True)), default=0)
    assert p.requested == sum(r.size for r in requests) >= p.nbytes


@settings(max_examples=100, deadline=None)
@given(_requests())
def test_placement_is_deterministic(requests: list[Request]) -> None:
    assert place(requests) == place(list(requests))


@settings(max_examples=200, deadline=None)
@given(_requests(one_size=True))
def test_requests_of_one_size_fit_in_the_live_peak(requests: list[Request]) -> None:
    assert place(requests).nbytes == live_peak(requests)


def test_requests_that_never_meet_share_one_place() -> None:
    requests = [Request(s * ALIGN, i + 1) for i, s in enumerate([3, 7, 1, 5])]
    p = place(requests)
    assert p.nbytes == 7 * ALIGN == p.live_peak
    assert set(p.offsets) == {0}


def test_requests_all_live_at_the_end_are_stacked() -> None:
    requests = [Request(s * ALIGN, None) for s in [3, 7, 1, 5]]
    p = place(requests)
    assert p.nbytes == 16 * ALIGN == p.live_peak


def test_a_stack_of_temporaries_reuses_the_freed_space() -> None:
    # a (4) lives throughout; b (2) dies before c (2) and d (1) are made: c and d go where b was
    requests = [Request(4 * ALIGN, None), Request(2 * ALIGN, 2), Request(2 * ALIGN, 4), Request(1 * ALIGN, 4)]
    p = place(requests)
    assert p.nbytes == p.live_peak == 7 * ALIGN


def test_best_fit_picks_the_smallest_gap_that_holds_the_request() -> None:
    # when request 4 (one unit) comes, 2 sits at 6 and 3 at 4: below them a gap of 4 units (0 died), between
    # them a gap of one; it takes the gap of one and leaves the big one whole
    units: list[tuple[int, int | None]] = [(4, 4), (2, 3), (1, None), (1, 5), (1, 5)]
    p = place([Request(s * ALIGN, e) for s, e in units])
    assert [o // ALIGN for o in p.offsets] == [0, 4, 6, 4, 5]
    assert p.nbytes == p.live_peak == 7 * ALIGN


def test_malformed_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        place([Request(100, None)])
    with pytest.raises(ValueError, match="request 0: end 0"):
        place([Request(ALIGN, 0)])


def test_aligned_rounds_up_to_256_bytes_and_at_least_one_unit() -> None:
    assert [aligned(n) for n in (0, 1, 256, 257, 1000)] == [256, 256, 256, 512, 1024]


# -- recording and serving on a fake device --------------------------------------------------------------------
class FakePointer:
    """What a CuPy allocator returns, as far as the runs are concerned: an address that keeps its owner."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.address = address
        self.nbytes = nbytes
        self.owner = owner


class PoolBlock:
    pass


class FakeMemory:
    """Pool blocks far above any arena, each a fresh object whose life the test can watch."""

    def __init__(self) -> None:
        self.next = 1 << 40
        self.blocks: list[weakref.ref[PoolBlock]] = []

    def block(self, nbytes: int) -> tuple[int, object]:
        address = self.next
        self.next += aligned(nbytes)
        keep = PoolBlock()
        self.blocks.append(weakref.ref(keep))
        return address, keep

    def pointer(self, address: int, nbytes: int, owner: object) -> object:
        return FakePointer(address, nbytes, owner)


ARENA_BASE = 1 << 20

# a step as the allocator sees it: ("alloc", name, bytes) and ("free", name)
Script = list[tuple[Any, ...]]

STEP: Script = [
    ("alloc", "h", 4000), ("alloc", "t", 1000), ("alloc", "u", 4000), ("free", "t"), ("alloc", "v", 300),
    ("free", "h"), ("alloc", "w", 8000), ("free", "u"), ("free", "v"), ("alloc", "loss", 4), ("free", "w"),
]


class Driver:
    """Runs a script against an allocator function, checking that no two live pointers overlap."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.live: dict[str, FakePointer] = {}

    def alloc(self, name: str, nbytes: int) -> None:
        # a method of its own, so that no local variable keeps a pointer alive past its free
        p = self.run(nbytes)
        assert isinstance(p, FakePointer)
        for other, q in self.live.items():
            assert not _overlap((p.address, p.address + aligned(p.nbytes)),
                                (q.address, q.address + aligned(q.nbytes))), (name, other)
        self.live[name] = p

    def play(self, script: Script) -> dict[str, FakePointer]:
        was = gc.isenabled()
        gc.disable()
        try:
            for step in script:
                if step[0] == "alloc":
                    self.alloc(step[1], step[2])
                else:
                    del self.live[step[1]]
            self.run.finish()
        finally:
            if was:
                gc.enable()
        return self.live


def _record(script: Script) -> tuple[list[Request], FakeMemory]:
    memory = FakeMemory()
    run = RecordingRun(memory)
    Driver(run).play(script)
    return run.requests(), memory


def _serve(script: Script, placement: Placement, memory: FakeMemory | None = None) -> tuple[ServingRun, Driver]:
    run = ServingRun(memory or FakeMemory(), placement, ARENA_BASE, object())
    driver = Driver(run)
    driver.play(script)
    return run, driver


def test_recording_logs_each_request_size_and_when_it_was_freed() -> None:
    requests, _ = _record(STEP)
    assert requests == [Request(4096, 4), Request(1024, 3), Request(4096, 5), Request(512, 5), Request(8192, 6),
                        Request(256, None)]


def test_a_recorded_request_goes_back_to_the_pool_when_freed() -> None:
    memory = FakeMemory()
    run = RecordingRun(memory)
    p = run(1000)
    assert memory.blocks[0]() is not None
    del p
    assert memory.blocks[0]() is None
    assert run.ends == [1]


def test_frees_after_the_run_leave_the_request_live_at_its_end() -> None:
    memory = FakeMemory()
    run = RecordingRun(memory)
    kept = Driver(run).play(STEP)
    kept.clear()
    assert run.ends[-1] is None


def test_the_same_step_is_served_entirely_from_the_arena_at_the_planned_offsets() -> None:
    requests, _ = _record(STEP)
    placement = place(requests)
    run, driver = _serve(STEP, placement)
    assert run.fallbacks == 0 and run.first_fallback is None
    assert run.requests() == requests
    loss = driver.live["loss"]
    assert loss.address == ARENA_BASE + placement.offsets[-1]
    assert placement.nbytes < placement.requested  # freed space was reused


def test_an_arena_pointer_keeps_the_arena_alive() -> None:
    class Arena:
        pass

    arena = Arena()
    ref = weakref.ref(arena)
    requests, _ = _record(STEP)
    run = ServingRun(FakeMemory(), place(requests), ARENA_BASE, arena)
    del arena
    p = run(4000)
    del run
    assert ref() is not None
    del p
    assert ref() is None


def test_a_request_of_another_size_comes_from_the_pool() -> None:
    requests, _ = _record(STEP)
    changed = [s if s[:2] != ("alloc", "v") else ("alloc", "v", 600) for s in STEP]
    run, driver = _serve(changed, place(requests))
    assert run.fallbacks == 1
    assert run.first_fallback is not None and "request 3: 768 bytes, recorded 512" in run.first_fallback
    assert driver.live["loss"].address < 1 << 40  # the rest still from the arena


def test_a_request_held_past_its_recorded_free_is_not_overwritten() -> None:
    # t is freed right after u in the record; in this run it lives to the end, so whatever the plan put
    # in its place later must come from elsewhere
    requests, _ = _record(STEP)
    placement = place(requests)
    held = [s for s in STEP if s != ("free", "t")]
    run, driver = _serve(held, placement)  # Driver asserts that no two live pointers overlap
    assert "t" in driver.live
    t = driver.live["t"]
    clash = [i for i in range(3, len(requests))
             if _overlap((placement.offsets[1], placement.offsets[1] + placement.sizes[1]),
                         (placement.offsets[i], placement.offsets[i] + placement.sizes[i]))]
    assert clash  # the plan does reuse t's place...
    assert run.fallbacks == len(clash)  # ...and each such request came from the pool instead
    assert t.address == ARENA_BASE + placement.offsets[1]


def test_requests_beyond_the_recorded_run_come_from_the_pool() -> None:
    requests, _ = _record(STEP)
    run, driver = _serve([*STEP, ("alloc", "extra", 64)], place(requests))
    assert run.fallbacks == 1
    assert driver.live["extra"].address >= 1 << 40


def test_a_run_that_strayed_is_a_recording_of_itself() -> None:
    requests, _ = _record(STEP)
    strayed = [("alloc", "cache", 512), *STEP]  # e.g. a workspace made once, by the recording run
    run, _ = _serve(strayed, place(requests))
    assert run.fallbacks > 0
    again, _ = _serve(strayed, place(run.requests()))
    assert again.fallbacks == 0


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(1, 9000), st.integers(0, 1000)),
               min_size=1, max_size=60)


def _script(raw: list[tuple[str, int, int]]) -> Script:
    """A valid script from random draws: frees pick a live name by the drawn index."""
    script: Script = []
    live: list[str] = []
    for k, (kind, nbytes, pick) in enumerate(raw):
        if kind == "free" and live:
            script.append(("free", live.pop(pick % len(live))))
        else:
            live.append(f"r{k}")
            script.append(("alloc", f"r{k}", nbytes))
    return script


@settings(max_examples=200, deadline=None)
@given(ops, ops)
def test_serving_any_run_against_any_record_never_overlaps_two_live_requests(
        recorded: list[tuple[str, int, int]], served: list[tuple[str, int, int]]) -> None:
    requests, _ = _record(_script(recorded))
    placement = place(requests)
    _assert_sound(requests, placement)
    same, _ = _serve(_script(recorded), placement)
    assert same.fallbacks == 0
    _serve(_script(served), placement)  # Driver asserts it


def test_every_arena_address_is_aligned_and_inside_the_arena() -> None:
    requests, _ = _record(STEP)
    placement = place(requests)
    run = ServingRun(FakeMemory(), placement, ARENA_BASE, object())
    pointers = [run(n) for n in (4000, 1000, 4000)]
    for p in pointers:
        assert isinstance(p, FakePointer)
        assert (p.address - ARENA_BASE) % ALIGN == 0
        assert ARENA_BASE <= p.address <= ARENA_BASE + placement.nbytes - aligned(p.nbytes)
