from __future__ import annotations

from collections import Counter

from kvrouter.sim.policies import DynamoT0Policy, LeastLoadedPolicy

from .cluster import W0, W1, W2, book, cache, make_cluster, request

PROMPT = list(range(1, 9))


def test_ignores_overlap_where_the_reference_cost_takes_it():
    """W0 caches the whole prompt but carries one small request: 20 blocks of cost against 16 on the idle
    workers without credit; with credit (dynamo_t0) W0 costs 10 - 8 + 10 = 12 and wins."""
    cluster = make_cluster()
    cache(cluster, W0, PROMPT)
    book(cluster, W0, [100, 101])
    least = Counter(LeastLoadedPolicy(seed=s).choose(request(PROMPT), cluster) for s in range(40))
    assert set(least) == {W1, W2}
    assert DynamoT0Policy(seed=0).choose(request(PROMPT), cluster) == W0


def test_picks_the_worker_with_the_least_queued_prefill_and_active_blocks():
    cluster = make_cluster()
    book(cluster, W0, [100, 101, 102])
    book(cluster, W1, [200], prefilled=True)
    book(cluster, W2, [300, 301], prefilled=True)
    assert LeastLoadedPolicy().choose(request(PROMPT), cluster) == W1
