from __future__ import annotations

import pytest

from kvrouter.errors import ConfigError
from kvrouter.routing import RouterConfig
from kvrouter.sim.policies import POLICIES, KvRouterPolicy, SglangCacheAwarePolicy, make_policy
from kvrouter.sim.policy import Policy

from .cluster import WORKERS, cache, make_cluster, request

NAMES = [
    "random",
    "round_robin",
    "least_loaded",
    "sglang_cache_aware",
    "dynamo_t0",
    "greedy_overlap",
    "chwbl",
    "lmetric",
    "preble_e2",
    "kvrouter",
]


def test_registry_lists_the_ten_policies_by_their_own_names():
    assert list(POLICIES) == NAMES
    assert all(cls.name == name for name, cls in POLICIES.items())


@pytest.mark.parametrize("name", NAMES)
def test_make_policy_builds_each(name):
    policy = make_policy(name, seed=3)
    assert isinstance(policy, Policy)
    assert policy.name == name


def test_make_policy_passes_options_on():
    kv = make_policy("kvrouter", seed=1, config=RouterConfig(router_temperature=0.5))
    assert isinstance(kv, KvRouterPolicy)
    assert kv.config.router_temperature == 0.5
    assert kv.seed == 1
    sglang = make_policy("sglang_cache_aware", cache_threshold=0.3)
    assert isinstance(sglang, SglangCacheAwarePolicy)
    assert sglang.cache_threshold == 0.3


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ConfigError, match="unknown policy 'fastest'"):
        make_policy("fastest", seed=0)
    with pytest.raises(ConfigError, match="does not take"):
        make_policy("round_robin", seed=0, cache_threshold=0.3)


def _drive(name: str, seed: int) -> list[tuple[int, int]]:
    """Forty requests over a few shared prefixes, booked, cached, and half finished, as a simulator would."""
    cluster = make_cluster(seed=seed)
    policy = make_policy(name, seed=seed)
    chosen: list[tuple[int, int]] = []
    for i in range(40):
        cluster.now = 10.0 * i
        req = request([i % 3, 10 + i % 5, 100 + i], output_tokens=5)
        worker = policy.choose(req, cluster)
        assert worker in WORKERS
        cluster.slots.add_request(req.request_id, worker, list(req.local_hashes), req.input_tokens, 0)
        policy.routed(req, worker, cluster)
        cache(cluster, worker, req.local_hashes)
        if i % 2:
            cluster.slots.free(req.request_id)
            policy.finished(req, worker, cluster)
        chosen.append(worker)
    return chosen


@pytest.mark.parametrize("name", NAMES)
def test_each_policy_repeats_its_choices_for_a_seed(name):
    assert _drive(name, seed=11) == _drive(name, seed=11)
