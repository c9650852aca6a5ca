"""``RouterConfig``: the routing knobs, named and defaulted as the reference's ``KvRouterConfig``.

Every field the reference has and kvrouter implements keeps the reference's name and default
(``spec/dynamo-semantics.md`` §4.1; ``tests/routing/test_config.py`` compares them with the 1.6.1
binding field by field), so a Dynamo operator's settings carry over unchanged. Fields the reference
keeps elsewhere (busy thresholds are frontend flags there) use the flag's name. Fields kvrouter does
not implement are absent rather than accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Final, Literal

from ..errors import ConfigError

__all__ = ["KVROUTER_CONFIG", "RouterConfig"]

SHARED_CACHE_DEFAULT_MULTIPLIER: Final = 0.5
"""Credit per shared-cache block when a shared cache is on and no multiplier is set (§4.1)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router weighs cache overlap against load; immutable, validated on construction.

    Raises:
        ConfigError: a weight, scale, temperature or threshold that is negative or not finite; the
            message names the field.
    """

    overlap_score_credit: float = 1.0
    """Blocks of prefill credited per device-overlap block."""
    overlap_score_credit_decay: float = 0.0
    """Shrinks the device credit of workers with more queued prefill than the least loaded (§4.2)."""
    prefill_load_scale: float = 1.0
    """Multiplier on the adjusted prefill blocks."""
    decode_active_request_weight: float = 0.0
    """Block-equivalents of decode cost per active request."""
    prefill_work_weight: float = 0.0
    """kvrouter's own term, not the reference's (0: off, the reference's behaviour): scales each worker's
    cost by ``max(0, 1 + weight * (recent - mean) / mean)``, where ``recent`` is the uncached prefill the
    worker was booked over the last minute or so (``SlotManager.recent_prefill_tokens``) and ``mean`` its
    mean over the eligible candidates (``kvrouter/routing/cost.py``)."""
    host_cache_hit_weight: float = 0.75
    """Credit per block found in host memory beyond the device overlap."""
    disk_cache_hit_weight: float = 0.25
    """Credit per block found on disk beyond the host overlap."""
    shared_cache_multiplier: float | None = None
    """Credit per block found only in the shared cache; None: 0.5 when ``shared_cache_type`` is set, else 0."""
    shared_cache_type: Literal["none", "hicache"] = "none"
    """External shared KV cache in use, if any."""
    router_temperature: float = 0.0
    """0: argmin with a random tie-break; above 0: softmax sampling over normalised costs."""
    router_selection_policy: Literal["default", "lmetric"] = "default"
    """What is minimised: ``"default"``, the reference's cost (a sum); ``"lmetric"``, the reference's opt-in
    ``adjusted_prefill_blocks * (decode_blocks + 1)`` (``spec/dynamo-semantics.md`` §4.2, after LMetric)."""
    use_kv_events: bool = True
    """False: approximate mode, the router's own decisions stand in for KV events (with a TTL)."""
    router_ttl_secs: float = 120.0
    """Seconds a routed block is assumed cached in approximate mode."""
    router_track_active_blocks: bool = True
    """Count the blocks of active requests in the decode term."""
    router_track_prefill_tokens: bool = True
    """Count queued prefill tokens in the prefill term."""
    router_assume_kv_reuse: bool = True
    """Active requests that share a prefix share its blocks (False: every request's blocks are its own)."""
    active_decode_blocks_threshold: float | None = None
    """Busy when active decode blocks exceed this fraction of the worker's KV capacity (Dynamo's
    ``--active-decode-blocks-threshold``); None: off. Workers of unknown capacity are never busy by it."""
    active_prefill_tokens_threshold: int | None = None
    """Busy when active prefill tokens exceed this (``--active-prefill-tokens-threshold``); None: off."""
    untrusted_overlap_weight: float = 1.0
    """kvrouter's own (1: off, the reference's behaviour): multiplies every overlap credit of a worker the
    caller marked untrusted (``Router.set_untrusted``: the service marks the workers whose trust state is
    not ``exact``, ``service/trust.py``), so a router that may have lost part of a worker's history leans
    less on it. In 0..1."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"RouterConfig.{spec.name} must be a finite number >= 0, got {value!r}")
        if self.untrusted_overlap_weight > 1:
            raise ConfigError(
                f"RouterConfig.untrusted_overlap_weight must be in 0..1, got {self.untrusted_overlap_weight!r}"
            )
        if self.router_ttl_secs <= 0:
            raise ConfigError(f"RouterConfig.router_ttl_secs must be > 0, got {self.router_ttl_secs!r}")
        if self.router_selection_policy not in ("default", "lmetric"):
            raise ConfigError(
                "RouterConfig.router_selection_policy must be 'default' or 'lmetric', "
                f"got {self.router_selection_policy!r}"
            )
        if self.shared_cache_type not in ("none", "hicache"):
            raise ConfigError(
                f"RouterConfig.shared_cache_type must be 'none' or 'hicache', got {self.shared_cache_type!r}"
            )

    @property
    def shared_credit(self) -> float:
        """The shared-cache credit actually applied (the multiplier, or its default when a cache is on)."""
        if self.shared_cache_multiplier is not None:
            return self.shared_cache_multiplier
        return SHARED_CACHE_DEFAULT_MULTIPLIER if self.shared_cache_type != "none" else 0.0


KVROUTER_CONFIG: Final = RouterConfig(
    router_selection_policy="lmetric", overlap_score_credit=1.5, prefill_work_weight=1.0
)
"""kvrouter's own tuning, the ``kvrouter`` policy of the routing benchmark: the reference's opt-in product
cost, with device overlap credited 1.5 blocks a block, scaled by each worker's share of the recent
uncached prefill (weight 1: a worker booked twice the mean recent prefill costs twice as much).

The product cost balances only what is in flight (queued prefill until the first token, active blocks),
so the prefill work each worker did drifts apart like a random walk: cache affinity sends a session's
or a hot prefix's requests to one worker, and with more workers each gets fewer such units. At 16
workers the uncached-prefill imbalance reached 1.16 (conversation) and 1.21 (synthetic) without the
work term, 1.07 and 1.02 with it, at the same hit rate and TTFT (``docs/routing-benchmark.md``, with
held-out worker counts, speed-ups and trace segments). Credit 1.75 and 2.0 pushed S8's prefill
imbalance past 1.10 before the work term existed. ``RouterConfig()`` stays the reference's behaviour."""
