from __future__ import annotations

from kvrouter.sim.policies import DynamoT0Policy

from .cluster import W0, W1, W2, book, cache, make_cluster, request

PROMPT = list(range(1, 11))
"""10 blocks, so the raw prefill is 10 blocks on every idle worker (as in the §4.2a example)."""


def _cluster(w2_active_blocks: int):
    """Overlaps 2 / 5 / 8 blocks; W2, the best cached, also runs ``w2_active_blocks`` blocks of decode."""
    cluster = make_cluster()
    cache(cluster, W0, PROMPT[:2])
    cache(cluster, W1, PROMPT[:5])
    cache(cluster, W2, PROMPT[:8])
    book(cluster, W2, range(500, 500 + w2_active_blocks), prefilled=True)
    return cluster


def test_trades_overlap_against_decode_load_as_the_cost_says():
    # costs: W0 10 - 2 + 10 = 18; W1 10 - 5 + 10 = 15; W2 10 - 8 + (10 + active)
    assert DynamoT0Policy().choose(request(PROMPT), _cluster(2)) == W2  # 14 < 15
    assert DynamoT0Policy().choose(request(PROMPT), _cluster(4)) == W1  # 16 > 15


def test_queued_prefill_pushes_a_request_off_its_cached_worker():
    cluster = make_cluster()
    cache(cluster, W0, PROMPT)
    book(cluster, W0, [], prefill_tokens=12 * 4)  # 12 blocks of prompt waiting: 22 - 10 + 10 = 22 > 20
    assert DynamoT0Policy().choose(request(PROMPT), cluster) in {W1, W2}


def test_never_books_the_request():
    cluster = _cluster(2)
    DynamoT0Policy().choose(request(PROMPT), cluster)
    assert [cluster.slots.active_requests(w) for w in (W0, W1, W2)] == [0, 0, 1]


def test_seeded_tie_breaks_repeat_and_spread():
    def picks(seed: int) -> list[tuple[int, int]]:
        policy, cluster = DynamoT0Policy(seed=seed), make_cluster()
        return [policy.choose(request(PROMPT), cluster) for _ in range(30)]

    assert picks(1) == picks(1)
    assert set(picks(1)) == {W0, W1, W2}
