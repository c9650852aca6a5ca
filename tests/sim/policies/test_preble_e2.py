from __future__ import annotations

import pytest

from kvrouter.errors import ConfigError
from kvrouter.sim.policies import PrebleE2Policy

from .cluster import W0, W1, W2, B, cache, make_cluster, request

PROMPT = list(range(1, 11))
"""10 blocks, 40 tokens: a cached prefix of 6 blocks (24 tokens) outweighs the uncached 16; 5 does not."""


def _loaded_policy(cluster, worker, tokens: int) -> PrebleE2Policy:
    """A policy that routed ``tokens`` of cold prompt (and no output) to ``worker`` just now."""
    policy = PrebleE2Policy()
    policy.routed(request(range(900, 900 + tokens // B), output_tokens=0), worker, cluster)
    assert policy.load(worker) == tokens
    return policy


def test_exploits_a_prefix_longer_than_the_rest_of_the_prompt_despite_load():
    cluster = make_cluster()
    cache(cluster, W0, PROMPT[:6])
    policy = _loaded_policy(cluster, W0, 400)
    assert policy.choose(request(PROMPT), cluster) == W0


def test_explores_the_least_loaded_worker_when_the_prefix_is_not_longer():
    cluster = make_cluster()
    cache(cluster, W0, PROMPT[:5])  # 20 cached tokens against 20 uncached: not longer
    policy = _loaded_policy(cluster, W0, 400)
    assert policy.choose(request(PROMPT), cluster) in {W1, W2}


def test_explore_counts_the_new_requests_uncached_prefill():
    """No recent work anywhere: W0 saves 20 of the 40 tokens, so exploring still picks it."""
    cluster = make_cluster()
    cache(cluster, W0, PROMPT[:5])
    assert PrebleE2Policy().choose(request(PROMPT), cluster) == W0
    policy = _loaded_policy(cluster, W0, 24)  # 24 + 20 > 0 + 40
    assert policy.choose(request(PROMPT), cluster) in {W1, W2}


def test_exploit_ties_go_to_the_least_loaded_holder():
    cluster = make_cluster()
    cache(cluster, W0, PROMPT[:8])
    cache(cluster, W1, PROMPT[:8])
    policy = _loaded_policy(cluster, W0, 100)
    assert policy.choose(request(PROMPT), cluster) == W1


def test_routed_charges_uncached_prefill_and_output_and_the_window_forgets_it():
    cluster = make_cluster()
    cache(cluster, W0, PROMPT[:6])
    policy = PrebleE2Policy(window_secs=180.0)
    routed = request(PROMPT, output_tokens=30)
    assert policy.choose(routed, cluster) == W0
    policy.routed(routed, W0, cluster)
    assert policy.load(W0) == 16 + 30
    cluster.now = 179.0
    policy.choose(request([1]), cluster)
    assert policy.load(W0) == 46
    cluster.now = 180.0
    policy.choose(request([1]), cluster)
    assert policy.load(W0) == 0


def test_rejects_an_empty_window():
    with pytest.raises(ConfigError):
        PrebleE2Policy(window_secs=0)
