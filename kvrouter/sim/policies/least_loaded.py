"""``least_loaded``: Dynamo's cost with the overlap credit at 0, so only queued prefill and active blocks count.

The mocker's ``kv_load_only`` anchor (``spec/routing-benchmark.md`` §6: ``overlap_score_credit=0``): every
worker is charged the whole prompt, and the cheapest is the one with the least prefill queued plus the
fewest active blocks after this request. It routes on load alone yet through the same slot accounting as
the cache-aware policies, so the gap between the two is the cache's worth, not a bookkeeping difference.
Host and disk weights keep their defaults, as in the anchor; the simulated engines report device blocks only.
"""

from __future__ import annotations

from ...routing import RouterConfig
from ._router import RouterPolicy

__all__ = ["LeastLoadedPolicy"]


class LeastLoadedPolicy(RouterPolicy):
    """Minimum of prefill blocks plus decode blocks, cache overlap ignored.

    Args:
        seed: seeds the tie-break among equally loaded workers.
    """

    name = "least_loaded"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(RouterConfig(overlap_score_credit=0.0), seed=seed)
