"""``RouterConfig``: the routing knobs, named and defaulted as the reference's ``KvRouterConfig``.

Every field the reference has and kvrouter implements keeps the reference's name and default
(``spec/dynamo-semantics.md`` §4.1; ``tests/routing/test_config.py`` compares them with the 1.6.1
binding field by field), so a Dynamo operator's settings carry over unchanged. Fields the reference
keeps elsewhere (busy thresholds are frontend flags there) use the flag's name. Fields kvrouter does
not implement are absent rather than accepted and ignored.

A field's ``metadata`` declares the ``kvrouter up`` option that sets it (``kvrouter/options.py``), with
Dynamo's flag spelling (``--router-kv-overlap-score-credit`` sets ``overlap_score_credit``); its default
there is :data:`KVROUTER_CONFIG`'s value, ``ServiceConfig.router``'s default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Final, Literal

from ..errors import ConfigError
from ..options import Panel, option

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

    router_selection_policy: Literal["default", "lmetric"] = field(
        default="default",
        metadata=option(
            "--router-selection-policy",
            help="What is minimised: "
            "'default' (the reference's sum) or 'lmetric' (prefill x decode, kvrouter's tuned default).",
            panel=Panel.COST,
        ),
    )
    """What is minimised: ``"default"``, the reference's cost (a sum); ``"lmetric"``, the reference's opt-in
    ``adjusted_prefill_blocks * (decode_blocks + 1)`` (``spec/dynamo-semantics.md`` §4.2, after LMetric)."""
    overlap_score_credit: float = field(
        default=1.0,
        metadata=option(
            "--router-kv-overlap-score-credit",
            help="[blocks per cached block] Prefill credit of a device-cache hit.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """Blocks of prefill credited per device-overlap block."""
    overlap_score_credit_decay: float = field(
        default=0.0,
        metadata=option(
            "--router-kv-overlap-score-credit-decay",
            help="Shrinks the credit of workers with more queued prefill than the least loaded.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """Shrinks the device credit of workers with more queued prefill than the least loaded (§4.2)."""
    prefill_load_scale: float = field(
        default=1.0,
        metadata=option(
            "--router-prefill-load-scale",
            help="Multiplier on the uncached prefill blocks.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """Multiplier on the adjusted prefill blocks."""
    decode_active_request_weight: float = field(
        default=0.0,
        metadata=option(
            "--router-decode-active-request-weight",
            help="[blocks per request] Decode cost of each active request.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """Block-equivalents of decode cost per active request."""
    prefill_work_weight: float = field(
        default=0.0,
        metadata=option(
            "--router-prefill-work-weight",
            help="kvrouter's term: scales a worker's cost by its share of the last minute's uncached prefill "
            "(0 = the reference's behaviour).",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """kvrouter's own term, not the reference's (0: off, the reference's behaviour): scales each worker's
    cost by ``max(0, 1 + weight * (recent - mean) / (mean + ISL))``, where ``recent`` is the uncached prefill
    the worker was booked over the last minute or so (``SlotManager.recent_prefill_tokens``), ``mean`` its
    mean over the eligible candidates and ISL the request's prompt tokens (``kvrouter/routing/cost.py``)."""
    predicted_credit: float = field(
        default=0.0,
        metadata=option(
            "--router-predicted-credit",
            help="kvrouter's: [blocks per block] credit of prompt blocks just routed to a worker and not yet "
            "in its events, when decisions keep finding every candidate with prefill queued (0 = off, the "
            "reference's behaviour).",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """kvrouter's own term (0: off, the reference's behaviour): the predicted tier. A worker's in-flight
    requests hold leading blocks of the prompt that its KV events have not confirmed yet (the prefill
    that makes them is queued or running); each is credited ``min(1, w)`` blocks at light load, rising
    linearly to ``w`` as the load the decisions see (``SlotManager.seen_load``: the share of candidates with
    prefill queued, averaged over seconds) goes from ``cost.PREDICTED_IDLE_SHARE`` to 1
    (``cost.predicted_weight``).
    The blocks come from the table of active requests' shared blocks, so with ``router_track_active_blocks``
    or ``router_assume_kv_reuse`` off there are none and the tier credits nothing."""
    credit_load_gain: float = field(
        default=0.0,
        metadata=option(
            "--router-credit-load-gain",
            help="kvrouter's: the device credit grows by this fraction of itself as the share of candidates "
            "with prefill queued goes from 0 to 1 (0 = off, the reference's behaviour).",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """kvrouter's own term (0: off, the reference's behaviour): a decision credits each device-overlap block
    ``overlap_score_credit * (1 + gain * share)``, ``share`` being the eligible candidates with prefill queued
    over all eligible candidates (``cost.credit_scale``). On an idle fleet a cached prefix is worth what it
    saves the request; on a queued one computing it again also delays what waits behind it, as for the
    predicted tier."""
    untrusted_overlap_weight: float = field(
        default=1.0,
        metadata=option(
            "--router-untrusted-overlap-weight",
            help="kvrouter's: multiplies the overlap credit of workers whose trust is not exact "
            "(partial, stale, misconfigured; docs/insight.md); 1 = off.",
            panel=Panel.COST,
            min=0.0,
            max=1.0,
        ),
    )
    """kvrouter's own (1: off, the reference's behaviour): multiplies every overlap credit of a worker the
    caller marked untrusted (``Router.set_untrusted``: the service marks the workers whose trust state is
    not ``exact``, ``service/trust.py``), so a router that may have lost part of a worker's history leans
    less on it. In 0..1."""
    host_cache_hit_weight: float = field(
        default=0.75,
        metadata=option(
            "--router-host-cache-hit-weight",
            help="[blocks per cached block] Credit of a host-memory hit beyond the device overlap.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """Credit per block found in host memory beyond the device overlap."""
    disk_cache_hit_weight: float = field(
        default=0.25,
        metadata=option(
            "--router-disk-cache-hit-weight",
            help="[blocks per cached block] Credit of a disk hit beyond the host overlap.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """Credit per block found on disk beyond the host overlap."""
    shared_cache_multiplier: float | None = None
    """Credit per block found only in the shared cache; None: 0.5 when ``shared_cache_type`` is set, else 0."""
    shared_cache_type: Literal["none", "hicache"] = "none"
    """External shared KV cache in use, if any."""
    router_temperature: float = field(
        default=0.0,
        metadata=option(
            "--router-temperature",
            help="0: the cheapest worker (random tie-break); above 0: softmax sampling over normalised costs.",
            panel=Panel.COST,
            min=0.0,
        ),
    )
    """0: argmin with a random tie-break; above 0: softmax sampling over normalised costs."""
    use_kv_events: bool = field(
        default=True,
        metadata=option(
            "--router-kv-events",
            help="Index the engines' KV events; --no-: approximate mode, the router's own decisions stand in for them.",
            panel=Panel.EVENTS,
            negatable=True,
            env=("KVROUTER_ROUTER_USE_KV_EVENTS",),
        ),
    )
    """False: approximate mode, the router's own decisions stand in for KV events (with a TTL)."""
    router_ttl_secs: float = field(
        default=120.0,
        metadata=option(
            "--router-ttl-secs",
            help="[secs] How long a routed prefix counts as cached in approximate mode.",
            panel=Panel.EVENTS,
            min=0.001,
        ),
    )
    """Seconds a routed block is assumed cached in approximate mode."""
    router_track_active_blocks: bool = field(
        default=True,
        metadata=option(
            "--router-track-active-blocks",
            help="Count active requests' blocks in the decode term.",
            panel=Panel.COST,
            negatable=True,
        ),
    )
    """Count the blocks of active requests in the decode term."""
    router_track_prefill_tokens: bool = field(
        default=True,
        metadata=option(
            "--router-track-prefill-tokens",
            help="Count queued prefill tokens in the prefill term.",
            panel=Panel.COST,
            negatable=True,
        ),
    )
    """Count queued prefill tokens in the prefill term."""
    router_assume_kv_reuse: bool = field(
        default=True,
        metadata=option(
            "--router-assume-kv-reuse",
            help="Active requests sharing a prefix share its blocks.",
            panel=Panel.COST,
            negatable=True,
        ),
    )
    """Active requests that share a prefix share its blocks (False: every request's blocks are its own)."""
    active_decode_blocks_threshold: float | None = field(
        default=None,
        metadata=option(
            "--active-decode-blocks-threshold",
            help="[fraction of KV capacity] A worker above it is busy.",
            panel=Panel.OVERLOAD,
            min=0.0,
            max=1.0,
            show_default="off",
        ),
    )
    """Busy when active decode blocks exceed this fraction of the worker's KV capacity (Dynamo's
    ``--active-decode-blocks-threshold``); None: off. Workers of unknown capacity are never busy by it."""
    active_prefill_tokens_threshold: int | None = field(
        default=None,
        metadata=option(
            "--active-prefill-tokens-threshold",
            help="[tokens] A worker with more queued prefill is busy.",
            panel=Panel.OVERLOAD,
            min=0,
            show_default="off",
        ),
    )
    """Busy when active prefill tokens exceed this (``--active-prefill-tokens-threshold``); None: off."""

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

    def short_weights(self) -> dict[str, float]:
        """The cost weights by ``kvrouter top``'s short names, in its header's order: what the stats segment
        and ``kvrouter_router_weight`` publish."""
        return {
            "credit": self.overlap_score_credit,
            "scale": self.prefill_load_scale,
            "decode": self.decode_active_request_weight,
            "work": self.prefill_work_weight,
            "pred": self.predicted_credit,
            "gain": self.credit_load_gain,
            "T": self.router_temperature,
        }

    @property
    def shared_credit(self) -> float:
        """The shared-cache credit actually applied (the multiplier, or its default when a cache is on)."""
        if self.shared_cache_multiplier is not None:
            return self.shared_cache_multiplier
        return SHARED_CACHE_DEFAULT_MULTIPLIER if self.shared_cache_type != "none" else 0.0


KVROUTER_CONFIG: Final = RouterConfig(
    router_selection_policy="lmetric",
    overlap_score_credit=1.5,
    prefill_work_weight=1.0,
    predicted_credit=24.0,
    credit_load_gain=1.0,
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
imbalance past 1.10 before the work term existed.

The predicted tier (``predicted_credit`` 24: a block in flight on a worker is credited 1 block at light
load, rising to 24 as the load the decisions see, ``SlotManager.seen_load``, goes from 0.05 to 1) keeps a
burst of requests sharing a fresh prefix together until the worker's events arrive. On the agent fan-out
workload (8 workers) its hit rate at x10-x30 is 0.807-0.829, within 0.04 of SGLang's cache-aware policy's,
with TTFT p90 at most 1.03 times the best policy's (514-554 ms); without the tier, 0.43-0.46 and up to
11.8 s. The first version followed the queued share at the instant of each decision with weight 2: TTFT p90
352-525 ms but hit 0.71-0.79, and a larger weight on that share took x1's p90 past 1.10 times the best's.
Every goal holds for a weight of 20-32, a window of 2-6 s and an idle share of 0.03-0.05, on the grid's
held-out rows and on sixteen more fan-out traces (``docs/routing-benchmark.md``, "Choosing the weight");
the Mooncake rows move by at most 0.5 % in p90.

The device credit's load gain (``credit_load_gain`` 1: 1.5 a block on an idle fleet, 3 on a fully queued one)
keeps requests with the workers holding a popular prefix when recomputing it would delay the queues: RAG
x6's TTFT p90 fell from 409 to 318 ms and C8 went from hit 0.240 / p90 608 ms to 0.249 / 602, while the
bursty-chat rows, at light load, kept their 43 ms (a constant credit of 2 took them to 49).
``RouterConfig()`` stays the reference's behaviour."""
