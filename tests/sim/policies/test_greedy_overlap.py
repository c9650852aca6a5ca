from __future__ import annotations

from collections import Counter

from kvrouter.sim.policies import GreedyOverlapPolicy

from .cluster import W0, W1, W2, book, book_many, cache, make_cluster, request


def test_takes_the_longest_overlap_however_loaded():
    cluster = make_cluster()
    cache(cluster, W0, [1, 2, 3])
    cache(cluster, W1, [1, 2])
    book_many(cluster, W0, 50)
    book(cluster, W0, range(100, 140))
    assert GreedyOverlapPolicy().choose(request([1, 2, 3, 4]), cluster) == W0


def test_ties_go_to_the_first_worker_so_a_shared_first_block_collapses_it():
    cluster = make_cluster(seed=4)
    cache(cluster, W1, [1])
    cache(cluster, W2, [1])
    counts = Counter(GreedyOverlapPolicy().choose(request([1, 2]), cluster) for _ in range(50))
    assert counts == Counter({W1: 50})
    assert GreedyOverlapPolicy().choose(request([9]), cluster) == W0
