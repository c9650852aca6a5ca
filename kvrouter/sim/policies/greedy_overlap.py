"""``greedy_overlap``: the worker caching the longest prefix, load ignored; the negative control.

On conversation traces every request begins with the same system-prompt block, so the first worker to
cache it wins every later request: the policy must collapse onto one worker (``spec/routing-benchmark.md``
§6.3, §7), which shows a cache-aware policy needs its load term. Ties (including "no worker caches
anything") go to the first worker in cluster order, as a plain argmax does. A random tie-break was tried
first: once every worker held the shared first block, ties spread requests at random, which is a hidden
load balancer, and the control no longer collapsed on C4 (imbalance 1.37 instead of ~W).
"""

from __future__ import annotations

from ...events.model import WorkerKey
from ..policy import Cluster, Policy, Request

__all__ = ["GreedyOverlapPolicy"]


class GreedyOverlapPolicy(Policy):
    """Maximum device overlap from the KV-event index; the first of the tied."""

    name = "greedy_overlap"

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        overlaps = cluster.index.find_matches(request.local_hashes)
        return max(cluster.workers, key=lambda w: overlaps.get(w, 0))  # max keeps the first of equals
