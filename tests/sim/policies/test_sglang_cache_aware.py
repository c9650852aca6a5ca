from __future__ import annotations

import pytest

from kvrouter.errors import ConfigError
from kvrouter.sim.policies import SglangCacheAwarePolicy

from .cluster import W0, W1, W2, book_many, cache, make_cluster, request

PROMPT = list(range(1, 11))


def _route(policy: SglangCacheAwarePolicy, cluster, local_hashes, worker, at: float = 0.0) -> None:
    """Tell the policy it routed ``local_hashes`` to ``worker`` at ``at``."""
    cluster.now = at
    policy.routed(request(local_hashes), worker, cluster)


def test_imbalance_beyond_both_thresholds_sends_to_the_least_loaded():
    policy = SglangCacheAwarePolicy()
    cluster = make_cluster()
    _route(policy, cluster, PROMPT, W0)
    book_many(cluster, W0, 36)
    book_many(cluster, W1, 5)
    book_many(cluster, W2, 7)
    assert policy.choose(request(PROMPT), cluster) == W0  # spread 31: not above 32, the cache decides
    book_many(cluster, W0, 2)
    assert policy.choose(request(PROMPT), cluster) == W1  # spread 33 > 32 and 38 > 1.0001 * 5
    lenient = SglangCacheAwarePolicy(balance_rel_threshold=10.0)
    _route(lenient, cluster, PROMPT, W0)
    assert lenient.choose(request(PROMPT), cluster) == W0  # 38 is not above 10 * 5


def test_cache_threshold_switches_between_the_longest_prefix_and_the_smallest_tree():
    policy = SglangCacheAwarePolicy(cache_threshold=0.5)
    cluster = make_cluster()
    _route(policy, cluster, PROMPT, W0)  # W0's tree: 10 blocks
    _route(policy, cluster, [50, 51, 52, 53, 54, 55], W1)  # W1: 6
    _route(policy, cluster, [60, 61, 62], W2)  # W2: 3
    assert policy.choose(request([*PROMPT[:6], 70, 71, 72, 73]), cluster) == W0  # 6/10 > 0.5
    assert policy.choose(request([*PROMPT[:5], 70, 71, 72, 73, 74]), cluster) == W2  # 5/10: smallest tree
    assert [policy.tree_blocks(w) for w in (W0, W1, W2)] == [10, 6, 3]


def test_reads_only_its_own_tree_not_the_kv_events():
    policy = SglangCacheAwarePolicy()
    cluster = make_cluster()
    cache(cluster, W2, PROMPT)
    _route(policy, cluster, [40, 41], W0)
    _route(policy, cluster, [42], W2)
    assert policy.choose(request(PROMPT), cluster) == W1  # empty tree, though W2 caches the prompt


def test_choosing_does_not_insert_routing_does():
    policy = SglangCacheAwarePolicy()
    cluster = make_cluster()
    worker = policy.choose(request(PROMPT), cluster)
    assert policy.match(PROMPT) == (0, set())
    policy.routed(request(PROMPT), worker, cluster)
    assert policy.match(PROMPT) == (10, {worker})


def test_prunes_every_tree_to_its_most_recent_blocks_every_interval():
    policy = SglangCacheAwarePolicy(max_tree_blocks=4, eviction_interval_secs=60.0)
    cluster = make_cluster()
    _route(policy, cluster, [1, 2, 3, 4, 5, 6], W0, at=0.0)
    _route(policy, cluster, [1, 2, 3], W1, at=5.0)
    _route(policy, cluster, [1, 2, 7, 8], W0, at=10.0)
    assert policy.tree_blocks(W0) == 8
    cluster.now = 59.9
    policy.choose(request([9]), cluster)
    assert policy.tree_blocks(W0) == 8
    cluster.now = 60.0
    policy.choose(request([9]), cluster)
    assert [policy.tree_blocks(w) for w in (W0, W1)] == [4, 3]
    assert policy.match([1, 2, 7, 8]) == (4, {W0})  # the newest path survives whole
    assert policy.match([1, 2, 3, 4, 5, 6]) == (3, {W1})  # W0's older tail is gone; W1 keeps block 3
    _route(policy, cluster, [20, 21, 22], W1, at=70.0)
    cluster.now = 119.0
    policy.choose(request([9]), cluster)
    assert policy.tree_blocks(W1) == 6  # the next pruning is due at 120 s
    cluster.now = 120.0
    policy.choose(request([9]), cluster)
    assert policy.tree_blocks(W1) == 4
    assert policy.match([20, 21, 22]) == (3, {W1})
    assert policy.match([1, 2, 3]) == (2, {W0})  # W1 lost its two oldest blocks, 3 and 2


@pytest.mark.parametrize(
    "options",
    [
        {"cache_threshold": -1.0},
        {"balance_abs_threshold": float("nan")},
        {"eviction_interval_secs": 0.0},
        {"max_tree_blocks": 0},
    ],
)
def test_rejects_bad_parameters(options):
    with pytest.raises(ConfigError):
        SglangCacheAwarePolicy(**options)
