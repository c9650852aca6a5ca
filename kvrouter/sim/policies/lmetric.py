"""``lmetric``: uncached prefill if routed here times the running batch, multiplied rather than added.

The reference's opt-in ``router_selection_policy=lmetric`` (``spec/dynamo-semantics.md`` §4.2), after
LMetric (arXiv 2603.15202): ``adjusted_prefill_blocks * (potential_decode_blocks + 1)``. A product needs
no weight between the two terms, which is the point of it: a worker with a long cached prefix and a small
batch wins over one with either alone, whatever the units. Both factors are the terms of
:func:`kvrouter.routing.worker_cost` under ``RouterConfig()`` with the slot manager's load, so they mean
exactly what they mean in ``dynamo_t0``; ties go uniformly at random (the router's seeded RNG).
"""

from __future__ import annotations

from typing import Final

from ...routing import RouterConfig
from ._router import RouterPolicy

__all__ = ["LmetricPolicy"]

LMETRIC: Final = RouterConfig(router_selection_policy="lmetric")


class LmetricPolicy(RouterPolicy):
    """Minimum of adjusted prefill blocks * (potential decode blocks + 1): a Router under
    ``router_selection_policy="lmetric"``, so the factors are exactly the cost terms ``dynamo_t0`` adds.

    Args:
        seed: seeds the router's tie-break RNG.
    """

    name = "lmetric"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(LMETRIC, seed=seed)
