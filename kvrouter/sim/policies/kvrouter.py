"""``kvrouter``: the project's own router as it ships, with whatever config the benchmark is tuning.

Today that is ``RouterConfig()``, the reference's defaults, so it starts level with ``dynamo_t0``; the
config is a constructor argument so the temperature sweep and the event-lag runs of
``spec/routing-benchmark.md`` §4 are this policy with another config, not new policies.
"""

from __future__ import annotations

from ...routing import RouterConfig
from ._router import RouterPolicy

__all__ = ["KvRouterPolicy"]


class KvRouterPolicy(RouterPolicy):
    """kvrouter's default routing.

    Args:
        config: the router's configuration; ``RouterConfig()`` when None.
        seed: seeds the router's tie-break and sampling RNG.
    """

    name = "kvrouter"

    def __init__(self, config: RouterConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(config or RouterConfig(), seed=seed)
