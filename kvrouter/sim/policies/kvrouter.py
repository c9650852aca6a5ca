"""``kvrouter``: the project's own router as it ships, with ``KVROUTER_CONFIG`` (the product cost with
device overlap credited 1.5; see its docstring for the measurements behind it). The config is a
constructor argument, so the temperature sweep and the event-lag runs of ``spec/routing-benchmark.md`` §4
are this policy with another config, not new policies.
"""

from __future__ import annotations

from ...routing import RouterConfig
from ...routing.config import KVROUTER_CONFIG
from ._router import RouterPolicy

__all__ = ["KvRouterPolicy"]


class KvRouterPolicy(RouterPolicy):
    """kvrouter's default routing.

    Args:
        config: the router's configuration; ``KVROUTER_CONFIG`` when None.
        seed: seeds the router's tie-break and sampling RNG.
    """

    name = "kvrouter"

    def __init__(self, config: RouterConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(config or KVROUTER_CONFIG, seed=seed)
