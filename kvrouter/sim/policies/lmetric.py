"""``lmetric``: uncached prefill if routed here times the running batch, multiplied rather than added.

The reference's opt-in ``router_selection_policy=lmetric`` (``spec/dynamo-semantics.md`` §4.2), after
LMetric (arXiv 2603.15202): ``adjusted_prefill_blocks * (potential_decode_blocks + 1)``. A product needs
no weight between the two terms, which is the point of it: a worker with a long cached prefix and a small
batch wins over one with either alone, whatever the units. Both factors are the terms of
:func:`kvrouter.routing.worker_cost` under ``RouterConfig()`` with the slot manager's load, so they mean
exactly what they mean in ``dynamo_t0``; ties go uniformly at random through ``Cluster.rng``.
"""

from __future__ import annotations

from ...events.model import WorkerKey
from ...hashing import sequence_hashes
from ...routing import Load, Overlap, RouterConfig, choose, worker_cost
from ..policy import Cluster, Policy, Request

__all__ = ["LmetricPolicy"]


class LmetricPolicy(Policy):
    """Minimum of adjusted prefill blocks * (potential decode blocks + 1).

    Args:
        config: where the adjusted prefill's weights come from (credit, tier weights, tracking
            switches); ``RouterConfig()`` when None. Its temperature and decode weights are not used.
    """

    name = "lmetric"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        workers = cluster.workers
        slots = cluster.slots
        by_tier = cluster.index.find_matches_by_tier(request.local_hashes)
        seq_hashes = sequence_hashes(request.local_hashes)
        queued = {w: slots.active_prefill_tokens(w) for w in workers}
        least_queued = min(queued.values())
        scores: list[float] = []
        for worker in workers:
            cost = worker_cost(
                self.config,
                isl_tokens=request.input_tokens,
                block_size=cluster.block_size,
                overlap=Overlap.from_tiers(by_tier, worker),
                load=Load(
                    active_prefill_tokens=queued[worker],
                    potential_decode_blocks=slots.potential_decode_blocks(worker, seq_hashes),
                    active_requests=slots.active_requests(worker),
                ),
                min_active_prefill_tokens=least_queued,
            )
            scores.append(cost.adjusted_prefill_blocks * (cost.decode_blocks + 1))
        return workers[choose(scores, 0.0, cluster.rng)]
