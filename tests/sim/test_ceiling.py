"""``kvrouter.sim.ceiling`` reproduces the timing-free references of ``spec/routing-benchmark.md``:
the pooled-LRU ceilings of §6.3 and the infinite-cache full-block rates of §1 (±0.5 points)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrouter.sim.ceiling import lru_hit_rate, pooled_lru_ceiling
from kvrouter.sim.policy import Request
from kvrouter.sim.trace import load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
TOLERANCE = 0.005

POOLED = {
    "conversation-4w": ("conversation", 4, 0.191),
    "conversation-8w": ("conversation", 8, 0.276),
    "synthetic-4w": ("synthetic", 4, 0.391),
    "synthetic-8w": ("synthetic", 8, 0.551),
}
INFINITE = {"conversation": 0.373, "synthetic": 0.650}

_loaded: dict[str, tuple[Request, ...]] = {}


def requests_of(name: str) -> tuple[Request, ...]:
    if name not in _loaded:
        trace = load_trace(TRACES / f"mooncake_fast25_{name}_trace.jsonl")
        assert trace.skipped == ()
        _loaded[name] = trace.requests
    return _loaded[name]


@pytest.mark.parametrize("case", POOLED, ids=list(POOLED))
def test_pooled_ceiling_matches_the_spec(case):
    name, workers, expected = POOLED[case]
    assert pooled_lru_ceiling(requests_of(name), workers=workers) == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize("name", INFINITE)
def test_infinite_cache_matches_the_spec(name):
    assert lru_hit_rate(requests_of(name), capacity_blocks=None) == pytest.approx(INFINITE[name], abs=TOLERANCE)


def req(blocks: tuple[int, ...], tokens: int | None = None) -> Request:
    return Request(f"r{blocks}", 0.0, tokens if tokens is not None else 512 * len(blocks), 1, blocks)


def test_only_the_cached_prefix_counts():
    # (1, 9) caches 1 and 9; (2, 9) finds 9 cached but behind a missing block 2: not reusable.
    assert lru_hit_rate([req((1, 9)), req((2, 9))], capacity_blocks=None) == 0.0
    assert lru_hit_rate([req((1, 2)), req((1, 2, 3))], capacity_blocks=None) == pytest.approx(2 / 5)


def test_least_recently_used_block_goes_first():
    # capacity 2: after (1,), (2,), (1,) the cache holds 2 and 1 with 2 the oldest; (3,) evicts 2.
    requests = [req((1,)), req((2,)), req((1,)), req((3,)), req((1,)), req((2,))]
    assert lru_hit_rate(requests, capacity_blocks=2) == pytest.approx(2 / 6)


def test_hit_rate_is_over_input_tokens():
    # one reused block of 512 over 512 + 700 input tokens (the partial block is never cached)
    assert lru_hit_rate([req((1,), 512), req((1,), 700)], capacity_blocks=None) == pytest.approx(512 / 1212)


def test_empty_and_invalid():
    assert lru_hit_rate([], capacity_blocks=4) == 0.0
    with pytest.raises(ValueError, match="capacity"):
        lru_hit_rate([], capacity_blocks=0)
    with pytest.raises(ValueError, match="workers"):
        pooled_lru_ceiling([], workers=0)
