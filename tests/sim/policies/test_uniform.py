from __future__ import annotations

from collections import Counter

from kvrouter.sim.policies import RandomPolicy

from .cluster import W0, WORKERS, book_many, cache, make_cluster, request


def test_every_worker_is_about_equally_likely_whatever_the_cache_and_load():
    cluster = make_cluster(seed=3)
    cache(cluster, W0, [1, 2, 3, 4])
    book_many(cluster, W0, 10)
    policy = RandomPolicy()
    counts = Counter(policy.choose(request([1, 2, 3, 4]), cluster) for _ in range(3000))
    assert set(counts) == set(WORKERS)
    assert all(900 <= n <= 1100 for n in counts.values()), counts


def test_the_same_seed_draws_the_same_workers():
    def run(seed: int) -> list[tuple[int, int]]:
        cluster = make_cluster(seed=seed)
        policy = RandomPolicy()
        return [policy.choose(request([i]), cluster) for i in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)
