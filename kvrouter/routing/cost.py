"""The cost of sending one request to one worker: cached overlap per tier against queued load.

The reference's ``worker_logit`` (``scheduling/selector/default.rs``; ``spec/dynamo-semantics.md``
§4.2), term for term; lower is better::

    raw_prefill     = (active_prefill_tokens + ISL) / B          0 when prefill tracking is off
    credit_decay    = 1 / (1 + decay * max(0, active_prefill - min_active_prefill) / B / ceil(ISL / B))
    overlap_credit  = credit * credit_scale * credit_decay * device + host_w * (host - device)
                    + disk_w * (disk - host) + shared_w * (shared - disk)
                      times untrusted_w for a worker marked untrusted (1 by default)
                    + predicted_w * predicted
    adjusted        = max(0, raw_prefill - overlap_credit)
    cost            = prefill_load_scale * adjusted + potential_decode_blocks + request_w * active_requests
    lmetric         = adjusted * (potential_decode_blocks + 1)   (router_selection_policy="lmetric")
    work_factor     = max(0, 1 + work_w * (recent - mean_recent) / (mean_recent + ISL))  1 if work_w or mean_recent is 0
    total           = (cost or lmetric) * work_factor

``work_factor`` is kvrouter's, not the reference's (``prefill_work_weight``, default 0 = off): ``recent``
is the worker's recently booked uncached prefill (``SlotManager.recent_prefill_tokens``: each request's
tokens beyond its device overlap at booking, decayed as ``exp(-age / 60 s)``), ``mean_recent`` its mean
over the eligible candidates. The other terms see only what is in flight, so without it the prefill
work each worker did drifts apart under cache affinity, more so the more workers share the traffic. The
share is taken over ``mean_recent + ISL``, not ``mean_recent`` alone: differences in recent work smaller
than the request itself say nothing about balance. Over ``mean_recent`` alone, an idle fleet's one recent
request made every other worker's factor 0, so the next turn of a conversation went to a worker without
its history (its total 0 whatever its cache); on a busy fleet, where ``mean_recent`` is many requests,
the request's size changes the share by a few per cent.
``untrusted_w`` is kvrouter's too (``untrusted_overlap_weight``, default 1 = off): the service marks the
workers whose trust state is not ``exact`` (``service/trust.py``), and their overlap counts for less.
A factor rather than a sum: it is dimensionless (weight 1 = cost proportional to the worker's share of
recent work), so it needs no scale per trace, and a worker whose cost is 0 stays 0. Rejected: counting
all work ever booked (no recovery after a burst) and a window of fixed requests (it ignores time).

``credit_scale`` is kvrouter's (``credit_load_gain``, default 0 = off): ``1 + gain * share``, ``share`` the
eligible candidates with prefill queued over all eligible candidates (:func:`credit_scale`). The same
reasoning as the predicted tier's weight below: a cached block saves its request the prefill, and on a
queued fleet it also saves everyone waiting behind a recompute. With gain 1 the device credit runs from
1.5 on an idle fleet to 3 on a fully queued one. Its share is the queue at this instant, not the predicted
tier's seen load: with the seen load the conversation trace's hit rate fell (C8 0.247 to 0.238).

``predicted_w * predicted`` is kvrouter's too (``predicted_credit``, default 0 = off): the predicted tier.
``predicted`` is the prompt's leading blocks that the worker's in-flight requests hold beyond its device
overlap: blocks the router has just sent there, whose KV events have not arrived because the prefill that
makes them is queued or running. Without it, requests sharing a fresh prefix that arrive inside that
window find no overlap anywhere and scatter, each worker computing the prefix again. The prediction ends
when the events confirm it (the device overlap catches up and ``predicted`` falls to 0) or when the
requests that hold it leave the worker (finished, freed, swept as stale after 300 s, or dropped with their
worker). ``predicted_w`` (:func:`predicted_weight`) follows the load the decisions see
(``SlotManager.seen_load``: the share of eligible candidates with prefill queued at each decision,
averaged over seconds, each decision's share held over the time since the one before): 1 up to
``PREDICTED_IDLE_SHARE``, rising linearly to ``predicted_credit`` at 1. At weight 1 the cost is the
follower's wait on that worker (its queued prefill, the leader's remaining prefill among it, and the
follower's own blocks beyond the prefix) against the cost of computing the whole prompt elsewhere: the
rule "wait for a prefix when that is quicker than recomputing it". On an idle fleet that is all that
matters; on a busy one a recomputed prefix also delays everyone queued behind it, which the larger weight
counts. Untrusted workers' predictions are not weighted down: they are the router's own record, not the
worker's history.

Why that average, and not the share at this instant: a burst fills the queues it lands on, so within a
burst the instant share reads the burst's own earlier requests as load. On an idle fleet that kept later
followers together where spreading them answers sooner; under heavy load each burst began on a share
the last one had left, and its first followers scattered (fan-out hit rate 0.71 against SGLang's 0.84 at
x10). Held over the gap before it, the share a burst's first request finds weighs in full and its later
requests' views hardly at all. A plain time average of the queues was tried and rejected: it counts the
queue a burst leaves behind, so moderate loads (fan-out x5-x7) read as busy and kept bursts together,
TTFT p90 1.2-1.7 times the best policy's.

Tier overlaps arrive cumulative, as an index reports them (``device <= host <= disk <= shared``), and each
slower tier is credited only for the blocks it adds: the frontend docs' ``host_extra`` / ``disk_extra``
reading (§4.2, inferred there, not verified against the binding). Every field of :class:`Cost` is kept,
not just the total, because the explanation of a decision is these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ..events.model import StorageTier, WorkerKey
from .config import RouterConfig

__all__ = ["PREDICTED_IDLE_SHARE", "Cost", "Load", "Overlap", "credit_scale", "predicted_weight", "worker_cost"]

PREDICTED_IDLE_SHARE: Final = 0.05
"""The seen load up to which the predicted tier's weight stays at 1: what light load shows of its bursts (on
the fan-out trace at x1, 8 workers, 0.045 on average over decisions, 0.03-0.06 from p10 to p90). At 0 that
load raised the weight, kept bursts together and took x1's TTFT p90 past 1.10 times the best policy's;
0.03-0.05 hold every goal, 0.08 misses x10's hit rate (``docs/routing-benchmark.md``)."""


@dataclass(frozen=True, slots=True)
class Overlap:
    """Leading request blocks a worker holds, cumulative by tier: ``device <= host <= disk <= shared``."""

    device: int = 0
    host: int = 0
    disk: int = 0
    shared: int = 0
    predicted: int = 0
    """Not a tier of the index: leading blocks beyond ``device`` that the worker's in-flight requests hold
    (routed there, not yet in its events)."""

    @classmethod
    def from_tiers(cls, by_tier: Mapping[StorageTier, Mapping[WorkerKey, int]], worker: WorkerKey) -> Overlap:
        """One worker's overlap out of an index's ``find_matches_by_tier`` answer."""
        return cls(*(by_tier.get(tier, {}).get(worker, 0) for tier in StorageTier))


@dataclass(frozen=True, slots=True)
class Load:
    """What a worker is already doing, as the slot manager sees it for this request."""

    active_prefill_tokens: int = 0
    """Prompt tokens routed to it whose prefill has not finished."""
    potential_decode_blocks: int = 0
    """Its active blocks plus the blocks this request would add (``SlotManager.potential_decode_blocks``)."""
    active_requests: int = 0
    recent_prefill_tokens: float = 0.0
    """Uncached prefill booked on it lately, decayed (``SlotManager.recent_prefill_tokens``)."""


@dataclass(slots=True)
class Cost:
    """Every term of one worker's cost, in blocks. Not frozen: a frozen dataclass's ``__init__`` costs
    three times a plain one's (1.3 against 0.4 µs), and one is built on every decision; treat it as read
    only."""

    raw_prefill_blocks: float
    overlap_credit_blocks: float
    adjusted_prefill_blocks: float
    prefill_cost: float
    """``prefill_load_scale * adjusted_prefill_blocks``."""
    decode_blocks: int
    request_cost: float
    """``decode_active_request_weight * active_requests``."""
    total: float
    """What selection minimises: the sum of the terms, or, under ``router_selection_policy="lmetric"``,
    ``adjusted_prefill_blocks * (decode_blocks + 1)``; times ``work_factor``."""
    work_factor: float = 1.0
    """``max(0, 1 + prefill_work_weight * (recent - mean) / (mean + ISL))``; 1 when the weight or the mean is 0."""
    predicted_credit_blocks: float = 0.0
    """The part of ``overlap_credit_blocks`` the predicted tier gives: ``predicted_w * predicted``."""


def predicted_weight(config: RouterConfig, seen_load: float) -> float:
    """The credit per predicted block of one decision: ``min(1, w)`` up to a ``seen_load``
    (``SlotManager.seen_load``) of ``PREDICTED_IDLE_SHARE``, ``w`` at 1, linear in between; ``w`` is
    ``predicted_credit``."""
    weight = config.predicted_credit
    if weight == 0.0:
        return 0.0
    low = min(1.0, weight)
    return low + (weight - low) * max(0.0, seen_load - PREDICTED_IDLE_SHARE) / (1.0 - PREDICTED_IDLE_SHARE)


def credit_scale(config: RouterConfig, busy_share: float) -> float:
    """The device credit's factor in one decision: ``1 + credit_load_gain * busy_share`` (1 when the gain is 0)."""
    return 1.0 + config.credit_load_gain * busy_share


def worker_cost(
    config: RouterConfig,
    *,
    isl_tokens: int,
    block_size: int,
    overlap: Overlap,
    load: Load,
    min_active_prefill_tokens: int,
    mean_recent_prefill_tokens: float = 0.0,
    trusted: bool = True,
    predicted_w: float = 0.0,
    device_scale: float = 1.0,
) -> Cost:
    """The cost of one candidate worker.

    Args:
        config: the weights.
        isl_tokens: the request's prompt length in tokens.
        block_size: tokens per KV block.
        overlap: the request's cached overlap on this worker, per tier.
        load: this worker's load.
        min_active_prefill_tokens: the least active prefill among the candidates (for the credit decay).
        mean_recent_prefill_tokens: the mean ``recent_prefill_tokens`` over the eligible candidates
            (for ``prefill_work_weight``).
        trusted: False multiplies the credit by ``untrusted_overlap_weight``.
        predicted_w: this decision's credit per predicted block (:func:`predicted_weight`).
        device_scale: this decision's factor on the device credit (:func:`credit_scale`).
    """
    track_prefill = config.router_track_prefill_tokens
    raw_prefill = (load.active_prefill_tokens + isl_tokens) / block_size if track_prefill else 0.0
    decay = 1.0
    if config.overlap_score_credit_decay and track_prefill:
        request_blocks = max(1, math.ceil(isl_tokens / block_size))
        queued_beyond_least = max(0, load.active_prefill_tokens - min_active_prefill_tokens)
        decay = 1.0 / (1.0 + config.overlap_score_credit_decay * queued_beyond_least / block_size / request_blocks)
    credit = (
        config.overlap_score_credit * device_scale * decay * overlap.device
        + config.host_cache_hit_weight * max(0, overlap.host - overlap.device)
        + config.disk_cache_hit_weight * max(0, overlap.disk - overlap.host)
        + config.shared_credit * max(0, overlap.shared - overlap.disk)
    )
    if not trusted:
        credit *= config.untrusted_overlap_weight
    predicted_credit = predicted_w * overlap.predicted
    credit += predicted_credit
    adjusted = max(0.0, raw_prefill - credit)
    prefill_cost = config.prefill_load_scale * adjusted
    request_cost = config.decode_active_request_weight * load.active_requests
    if config.router_selection_policy == "lmetric":
        total = adjusted * (load.potential_decode_blocks + 1)
    else:
        total = prefill_cost + load.potential_decode_blocks + request_cost
    work_factor = 1.0
    if config.prefill_work_weight and mean_recent_prefill_tokens > 0:
        share = (load.recent_prefill_tokens - mean_recent_prefill_tokens) / (mean_recent_prefill_tokens + isl_tokens)
        work_factor = max(0.0, 1.0 + config.prefill_work_weight * share)
        total *= work_factor
    return Cost(
        raw_prefill_blocks=raw_prefill,
        overlap_credit_blocks=credit,
        adjusted_prefill_blocks=adjusted,
        prefill_cost=prefill_cost,
        decode_blocks=load.potential_decode_blocks,
        request_cost=request_cost,
        total=total,
        work_factor=work_factor,
        predicted_credit_blocks=predicted_credit,
    )
