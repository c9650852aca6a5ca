"""``dynamo_t0``: the reference's cost at temperature 0, the bar every other policy is measured against.

``RouterConfig()`` is Dynamo's ``KvRouterConfig()`` field for field (``spec/dynamo-semantics.md`` §4.1):
prefill load scale 1, overlap credit 1, temperature 0, argmin with a uniformly random tie-break, overlaps from
exact KV events. The parity bar of ``spec/routing-benchmark.md`` §7 asks it to land within ±0.01 hit rate
of the mocker's ``kv_default``; it is fixed, so tuning the default policy (``kvrouter``) cannot move it.
"""

from __future__ import annotations

from ...routing import RouterConfig
from ._router import RouterPolicy

__all__ = ["DynamoT0Policy"]


class DynamoT0Policy(RouterPolicy):
    """Dynamo's default routing: ``(active_prefill + ISL) / B - overlap + potential decode blocks``, argmin.

    Args:
        seed: seeds the tie-break among equally cheap workers.
    """

    name = "dynamo_t0"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(RouterConfig(), seed=seed)
