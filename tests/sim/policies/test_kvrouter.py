from __future__ import annotations

from kvrouter.routing import RouterConfig
from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.sim.policies import KvRouterPolicy

from .cluster import W0, W1, W2, book, cache, make_cluster, request

PROMPT = list(range(1, 9))


def test_defaults_to_kvrouters_own_tuning():
    assert KvRouterPolicy().config == KVROUTER_CONFIG
    assert (KVROUTER_CONFIG.router_selection_policy, KVROUTER_CONFIG.overlap_score_credit) == ("lmetric", 1.5)


def test_routes_by_its_config():
    """The least_loaded case: the default takes W0's cache, a config without overlap credit does not."""
    cluster = make_cluster()
    cache(cluster, W0, PROMPT)
    book(cluster, W0, [100, 101])
    assert KvRouterPolicy().choose(request(PROMPT), cluster) == W0
    no_credit = KvRouterPolicy(RouterConfig(overlap_score_credit=0.0), seed=2)
    assert no_credit.choose(request(PROMPT), cluster) in {W1, W2}


def test_busy_threshold_reads_the_cluster_capacity():
    cluster = make_cluster(capacity_blocks=10)
    cache(cluster, W0, PROMPT)
    book(cluster, W0, range(100, 106), prefilled=True)  # 6 of 10 blocks active: busy above 0.5
    busy_at_half = KvRouterPolicy(RouterConfig(active_decode_blocks_threshold=0.5))
    assert busy_at_half.choose(request(PROMPT), cluster) in {W1, W2}
    assert KvRouterPolicy().choose(request(PROMPT), cluster) == W0
