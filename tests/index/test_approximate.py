"""``ApproxIndex``: TTL expiry and refresh, size pruning in Dynamo's order, worker removal, and a model
check. Time is a :class:`FakeClock` moved by hand; nothing sleeps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from kvrouter.events.model import StorageTier, WorkerKey
from kvrouter.index import ApproxIndex, RadixIndex
from kvrouter.index.approximate import STALE_HEAP_FACTOR
from tests.clock import FakeClock

TTL = 120.0
W1: WorkerKey = (1, 0)
W2: WorkerKey = (2, 0)
A = [11, 12, 13, 14]
B = [21, 22, 23, 24]
C = [31, 32, 33]


@pytest.fixture
def index(clock: FakeClock) -> ApproxIndex:
    return ApproxIndex(ttl=TTL, clock=clock)


def test_routed_request_matches_on_its_worker_only(index: ApproxIndex):
    index.record_routing(W1, A)
    assert index.find_matches(A) == {W1: 4}
    assert index.find_matches([*A[:2], 99]) == {W1: 2}
    assert index.find_matches(A[1:]) == {}
    assert index.workers() == {W1}
    assert index.block_counts() == {W1: 4}


def test_blocks_expire_at_ttl(index: ApproxIndex, clock: FakeClock):
    index.record_routing(W1, A)
    clock.now = TTL - 1e-6
    assert index.find_matches(A) == {W1: 4}
    clock.now = TTL
    assert index.find_matches(A) == {}
    assert index.block_counts() == {W1: 0}
    assert index.workers() == {W1}


def test_routing_again_refreshes_the_expiry(index: ApproxIndex, clock: FakeClock):
    index.record_routing(W1, A)
    clock.now = 100.0
    index.record_routing(W1, A)
    clock.now = 200.0
    assert index.find_matches(A) == {W1: 4}
    clock.now = 220.0
    assert index.find_matches(A) == {}


def test_shared_prefix_takes_the_later_expiry(index: ApproxIndex, clock: FakeClock):
    index.record_routing(W1, A)
    clock.now = 50.0
    index.record_routing(W1, A[:2])
    clock.now = TTL
    assert index.find_matches(A) == {W1: 2}
    clock.now = 50.0 + TTL - 1e-6
    assert index.find_matches(A) == {W1: 2}
    clock.now = 50.0 + TTL
    assert index.find_matches(A) == {}


def test_expiry_of_one_worker_leaves_the_other(index: ApproxIndex, clock: FakeClock):
    index.record_routing(W1, A)
    clock.now = 10.0
    index.record_routing(W2, A)
    clock.now = TTL
    assert index.find_matches(A) == {W2: 4}


def test_size_pruning_drops_earliest_expiry_and_deepest_first(clock: FakeClock):
    index = ApproxIndex(ttl=TTL, max_blocks=10, prune_ratio=0.8, clock=clock)
    index.record_routing(W1, A)
    clock.now = 1.0
    index.record_routing(W1, B)
    clock.now = 2.0
    index.record_routing(W1, [41])
    assert index.block_counts() == {W1: 9}
    clock.now = 3.0
    index.record_routing(W1, [51, 52])  # 11 > 10: prune to 8, three of A's four blocks, deepest first
    assert index.block_counts() == {W1: 8}
    assert index.find_matches(A) == {W1: 1}
    assert index.find_matches(B) == {W1: 4}
    assert index.find_matches([41]) == {W1: 1}
    assert index.find_matches([51, 52]) == {W1: 2}


def test_size_pruning_ties_go_largest_key_then_largest_worker_first(clock: FakeClock):
    """Equal expiry and depth: Dynamo's max-heap pops the larger sequence hash, then the larger worker.

    A first block's sequence hash is its local hash, so the keys here are the numbers routed."""
    index = ApproxIndex(ttl=TTL, max_blocks=3, prune_ratio=1.0, clock=clock)
    index.record_routing((1, 0), [9])
    index.record_routing((1, 1), [9])
    index.record_routing((2, 0), [9])
    index.record_routing((1, 0), [3])  # 4 > 3: one of the three 9s goes, the largest worker's
    assert index.find_matches([9]) == {(1, 0): 1, (1, 1): 1}
    index.record_routing((2, 0), [5])  # then the larger dp rank's
    assert index.find_matches([9]) == {(1, 0): 1}
    index.record_routing((2, 0), [4])  # then the largest key
    assert index.find_matches([9]) == {}
    assert index.block_counts() == {(1, 0): 1, (1, 1): 0, (2, 0): 2}


def test_clear_all_blocks_drops_blocks_and_timers(index: ApproxIndex, clock: FakeClock):
    index.record_routing((1, 0), A)
    index.record_routing((1, 1), A)
    index.record_routing(W2, A)
    clock.now = 10.0
    index.clear_all_blocks(1)
    assert index.find_matches(A) == {W2: 4}
    assert index.workers() == {(1, 0), (1, 1), W2}
    index.record_routing((1, 0), A[:2])  # its timers start afresh: the cleared ones must not remove these
    clock.now = TTL
    assert index.find_matches(A) == {(1, 0): 2}
    clock.now = 10.0 + TTL
    assert index.find_matches(A) == {}
    assert index.block_counts() == {(1, 0): 0, (1, 1): 0, W2: 0}


def test_remove_worker_forgets_it(index: ApproxIndex, clock: FakeClock):
    index.record_routing((1, 0), A)
    index.record_routing((1, 1), B)
    index.record_routing(W2, A)
    index.remove_worker(1)
    assert index.workers() == {W2}
    assert index.find_matches(A) == {W2: 4}
    assert index.find_matches(B) == {}
    clock.now = 2 * TTL
    assert index.find_matches(A) == {}
    assert index.workers() == {W2}


def test_refreshing_keeps_the_heap_bounded(index: ApproxIndex, clock: FakeClock):
    # The one test that reads a private attribute: stale heap items are invisible through the API,
    # and unbounded growth of the heap is exactly what the rebuild exists to prevent.
    for step in range(1000):
        clock.now = step * 0.01
        index.record_routing(W1, A)
        assert len(index._heap) <= (STALE_HEAP_FACTOR + 1) * len(A)
    for _ in range(100):  # same instant: nothing new to push
        index.record_routing(W1, A)
    assert index.find_matches(A) == {W1: 4}


def test_find_matches_by_tier_is_all_device(index: ApproxIndex):
    index.record_routing(W1, A)
    index.record_routing(W2, A[:2])
    expected = {W1: 4, W2: 2}
    assert index.find_matches_by_tier(A) == {tier: expected for tier in StorageTier}
    assert index.find_matches(A, early_exit=True) == expected


def test_dump_rebuilds_the_unexpired_blocks(index: ApproxIndex, clock: FakeClock):
    index.record_routing(W1, A)
    clock.now = 10.0
    index.record_routing(W2, B)
    clock.now = TTL
    rebuilt = RadixIndex()
    for event in index.dump():
        rebuilt.apply_event(event.worker_id, event)
    assert rebuilt.find_matches(A) == {}
    assert rebuilt.find_matches(B) == {W2: 4}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"ttl": 0.0}, "ttl"),
        ({"ttl": -1.0}, "ttl"),
        ({"ttl": math.nan}, "ttl"),
        ({"max_blocks": 0}, "max_blocks"),
        ({"prune_ratio": 0.0}, "prune_ratio"),
        ({"prune_ratio": 1.5}, "prune_ratio"),
        ({"prune_ratio": math.nan}, "prune_ratio"),
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, float], name: str):
    with pytest.raises(ValueError, match=name):
        ApproxIndex(**kwargs)  # type: ignore[arg-type]


# -- model check ------------------------------------------------------------------------------------

REQUESTS = ([1, 2], [1, 2, 3, 4], [1, 5], [1, 2, 3, 6], [7])
"""A few requests sharing prefixes, so refreshes of one request reach into others."""
WORKERS: tuple[WorkerKey, ...] = ((1, 0), (2, 0), (2, 1))
MODEL_TTL = 50.0

steps = st.lists(
    st.tuples(st.integers(0, 60), st.sampled_from(WORKERS), st.sampled_from(range(len(REQUESTS)))),
    max_size=40,
)
"""(seconds to advance, worker, request): whole seconds make expiry land exactly on a step often."""


def expected_matches(model: dict[tuple[WorkerKey, tuple[int, ...]], float], now: float, query: list[int]):
    """Per worker, the longest prefix of ``query`` whose every block is routed there and unexpired."""
    scores = {}
    for worker in WORKERS:
        depth = 0
        while depth < len(query) and model.get((worker, tuple(query[: depth + 1])), -math.inf) > now:
            depth += 1
        if depth:
            scores[worker] = depth
    return scores


@settings(max_examples=200, deadline=None)
@given(steps)
def test_agrees_with_a_ttl_model(script: list[tuple[int, WorkerKey, int]]):
    clock = FakeClock()
    index = ApproxIndex(ttl=MODEL_TTL, clock=clock)
    model: dict[tuple[WorkerKey, tuple[int, ...]], float] = {}
    for advance, worker, request in script:
        clock.now += advance
        local = REQUESTS[request]
        index.record_routing(worker, local)
        for depth in range(1, len(local) + 1):
            model[(worker, tuple(local[:depth]))] = clock.now + MODEL_TTL
        for query in REQUESTS:
            assert index.find_matches(query) == expected_matches(model, clock.now, query), (clock.now, query)
        live = {
            w: sum(1 for (held_by, _), expiry in model.items() if held_by == w and expiry > clock.now)
            for w in {held_by for held_by, _ in model}
        }
        assert index.block_counts() == live


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(1, 8), st.sampled_from([0.25, 0.5, 0.8, 1.0]))
def test_pruning_keeps_the_size_bound_and_never_adds(script: list[tuple[int, WorkerKey, int]], max_blocks, ratio):
    """With pruning on, the index holds at most ``max_blocks`` entries, each worker's blocks stay
    prefix-closed, and no match exceeds what TTL alone would keep."""
    clock = FakeClock()
    index = ApproxIndex(ttl=MODEL_TTL, max_blocks=max_blocks, prune_ratio=ratio, clock=clock)
    model: dict[tuple[WorkerKey, tuple[int, ...]], float] = {}
    for advance, worker, request in script:
        clock.now += advance
        local = REQUESTS[request]
        index.record_routing(worker, local)
        for depth in range(1, len(local) + 1):
            model[(worker, tuple(local[:depth]))] = clock.now + MODEL_TTL
        counts = index.block_counts()
        assert sum(counts.values()) <= max_blocks
        for query in REQUESTS:
            got = index.find_matches(query)
            ttl_only = expected_matches(model, clock.now, query)
            assert all(score <= ttl_only.get(w, 0) for w, score in got.items()), (got, ttl_only)
        # Prefix-closed: every block a worker holds is reachable from the root, so the distinct blocks
        # along the matched prefixes of all requests account for its whole count.
        for w, count in counts.items():
            reachable = {tuple(q[:d]) for q in REQUESTS for d in range(1, index.find_matches(q).get(w, 0) + 1)}
            assert len(reachable) == count, (w, count, reachable)
