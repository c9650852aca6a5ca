from __future__ import annotations

from kvrouter.sim.policies import DynamoT0Policy, LmetricPolicy

from .cluster import W0, W1, book, cache, make_cluster, request

PROMPT = list(range(1, 11))


def _cluster(w0_active_blocks: int):
    """W0 caches 8 of the 10 blocks and runs ``w0_active_blocks`` blocks of decode; W1 is cold and idle."""
    cluster = make_cluster(workers=(W0, W1))
    cache(cluster, W0, PROMPT[:8])
    book(cluster, W0, range(500, 500 + w0_active_blocks), prefilled=True)
    return cluster


def test_minimises_uncached_prefill_times_the_batch():
    """W0: 2 * (active + 10 + 1); W1: 10 * (10 + 1) = 110. The product keeps W0 up to 43 active blocks,
    where the reference's sum (2 + active + 10 against 20) gives it up after 7."""
    assert LmetricPolicy().choose(request(PROMPT), _cluster(20)) == W0  # 62 < 110
    assert LmetricPolicy().choose(request(PROMPT), _cluster(43)) == W0  # 108 < 110
    assert LmetricPolicy().choose(request(PROMPT), _cluster(50)) == W1  # 122 > 110
    assert DynamoT0Policy().choose(request(PROMPT), _cluster(20)) == W1  # 32 > 20


def test_queued_prefill_counts_in_the_prefill_factor():
    cluster = _cluster(0)  # W0: 2 * 11 = 22
    book(cluster, W0, [], prefill_tokens=9 * 4)  # + 9 queued blocks: 11 * 11 = 121 > 110
    assert LmetricPolicy().choose(request(PROMPT), cluster) == W1
