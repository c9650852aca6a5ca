"""``greedy_overlap``: the worker caching the longest prefix, load ignored; the negative control.

On conversation traces every request begins with the same system-prompt block, so the first worker to
cache it wins every later request: the policy must collapse onto one worker (``spec/routing-benchmark.md``
§6.3, §7), which shows a cache-aware policy needs its load term. Ties (including "no worker caches
anything") go uniformly at random through ``Cluster.rng``.
"""

from __future__ import annotations

from ...events.model import WorkerKey
from ...routing import choose
from ..policy import Cluster, Policy, Request

__all__ = ["GreedyOverlapPolicy"]


class GreedyOverlapPolicy(Policy):
    """Maximum device overlap from the KV-event index; random among the tied."""

    name = "greedy_overlap"

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        overlaps = cluster.index.find_matches(request.local_hashes)
        workers = cluster.workers
        return workers[choose([-overlaps.get(w, 0) for w in workers], 0.0, cluster.rng)]
