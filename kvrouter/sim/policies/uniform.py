"""``random``: every worker equally likely, drawn from the run's seeded RNG; the floor of the benchmark.

The module is named for the distribution, not ``random.py``, so it cannot be mistaken for the standard
library module it uses nothing of: draws come from ``Cluster.rng``, so a run is repeated exactly by its seed.
"""

from __future__ import annotations

from ...events.model import WorkerKey
from ..policy import Cluster, Policy, Request

__all__ = ["RandomPolicy"]


class RandomPolicy(Policy):
    """A uniformly random worker per request."""

    name = "random"

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        return cluster.rng.choice(cluster.workers)
