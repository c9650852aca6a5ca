"""The routing policies the simulator compares (``spec/routing-benchmark.md`` §4), one module per policy.

Layout: ``uniform`` (``random``), ``round_robin``, ``least_loaded``, ``sglang_cache_aware``, ``dynamo_t0``,
``greedy_overlap``, ``chwbl``, ``lmetric``, ``preble_e2`` and ``kvrouter`` (the project's default), plus
``_router``, the base of the three that are a :class:`~kvrouter.routing.Router` with a fixed config.
:data:`POLICIES` maps each name ``kvrouter simulate --policy`` takes to its class; :func:`make_policy`
builds one for a run.
"""

from __future__ import annotations

from typing import Any, Final

from ...errors import ConfigError
from ..policy import Policy
from ._router import RouterPolicy
from .chwbl import ChwblPolicy
from .dynamo_t0 import DynamoT0Policy
from .greedy_overlap import GreedyOverlapPolicy
from .kvrouter import KvRouterPolicy
from .least_loaded import LeastLoadedPolicy
from .lmetric import LmetricPolicy
from .preble_e2 import PrebleE2Policy
from .round_robin import RoundRobinPolicy
from .sglang_cache_aware import SglangCacheAwarePolicy
from .uniform import RandomPolicy

__all__ = [
    "POLICIES",
    "ChwblPolicy",
    "DynamoT0Policy",
    "GreedyOverlapPolicy",
    "KvRouterPolicy",
    "LeastLoadedPolicy",
    "LmetricPolicy",
    "PrebleE2Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouterPolicy",
    "SglangCacheAwarePolicy",
    "make_policy",
]

POLICIES: Final[dict[str, type[Policy]]] = {
    cls.name: cls
    for cls in (
        RandomPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        SglangCacheAwarePolicy,
        DynamoT0Policy,
        GreedyOverlapPolicy,
        ChwblPolicy,
        LmetricPolicy,
        PrebleE2Policy,
        KvRouterPolicy,
    )
}
"""Every policy by the name it is run under, in the order of ``spec/routing-benchmark.md`` §4."""


def make_policy(name: str, *, seed: int = 0, **options: Any) -> Policy:
    """A fresh policy for one simulation run.

    Args:
        name: a key of :data:`POLICIES`.
        seed: seeds the policies that own an RNG (those built on a ``Router``); the others draw only
            from ``Cluster.rng``, which the simulator seeds.
        options: the policy's own constructor arguments (``config=`` for ``kvrouter``,
            ``cache_threshold=`` for ``sglang_cache_aware``, ...).

    Raises:
        ConfigError: an unknown name, an option the policy does not take, or a value it rejects.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    if issubclass(cls, RouterPolicy):
        options["seed"] = seed
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r} does not take options {sorted(options)}: {exc}") from exc
