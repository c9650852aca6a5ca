from __future__ import annotations

from kvrouter.sim.policies import RoundRobinPolicy

from .cluster import W0, W1, W2, book_many, cache, make_cluster, request


def test_cycles_through_the_workers_in_order_ignoring_cache_and_load():
    cluster = make_cluster()
    cache(cluster, W2, [1, 2, 3])
    book_many(cluster, W0, 5)
    policy = RoundRobinPolicy()
    chosen = [policy.choose(request([1, 2, 3]), cluster) for _ in range(7)]
    assert chosen == [W0, W1, W2, W0, W1, W2, W0]
