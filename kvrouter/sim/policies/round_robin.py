"""``round_robin``: the workers in turn, the baseline every ratio of the benchmark is taken against.

The simulator's calibration gate (``spec/routing-benchmark.md`` §7) compares this policy with the mocker's
round robin, which is bit-for-bit deterministic: so no randomness here, the cycle starts at the first
worker of ``Cluster.workers`` and advances once per decision, whatever happens to the request.
"""

from __future__ import annotations

from ...events.model import WorkerKey
from ..policy import Cluster, Policy, Request

__all__ = ["RoundRobinPolicy"]


class RoundRobinPolicy(Policy):
    """``workers[0], workers[1], ..., workers[n-1], workers[0], ...``."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0
        """Decisions made so far; the next worker is ``workers[_turn % len(workers)]``."""

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        worker = cluster.workers[self._turn % len(cluster.workers)]
        self._turn += 1
        return worker
