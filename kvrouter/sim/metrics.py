"""``RunResult``: what one simulation run measured (``spec/routing-benchmark.md`` §5).

Every figure is computed once, here, from raw per-request and per-worker records, with one definition
of a percentile: numpy's default (linear interpolation between closest ranks), so a p50 of two values is
their mean and reports can be recomputed from ``ttft_ms``. ITL is the exception: tokens come in runs of
identical intervals (a fast-forwarded stretch gives every decoding sequence the same interval), so ITL
samples are (interval, token count) pairs and the ITL p50 is the weighted inverted-CDF median (the
smallest interval with at least half the tokens at or below it), which for millions of tokens differs
from the linear definition by less than one interval step.

Imbalance figures are max / mean over workers (1.0 = even). The hit rate is the engine's: prompt tokens
reused from cache at admission / all prompt tokens (Dynamo's ``prefix_cache_reused_ratio``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["RunResult", "imbalance", "percentile", "weighted_percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by numpy's default linear definition; NaN for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def weighted_percentile(values: Sequence[float], weights: Sequence[int], q: float) -> float:
    """Smallest value with at least ``q``% of the total weight at or below it; NaN for no weight."""
    if not values:
        return float("nan")
    vals = np.asarray(values, dtype=np.float64)
    wts = np.asarray(weights, dtype=np.float64)
    total = wts.sum()
    if total <= 0:
        return float("nan")
    order = np.argsort(vals, kind="stable")
    cumulative = np.cumsum(wts[order])
    position = int(np.searchsorted(cumulative, total * q / 100.0, side="left"))
    return float(vals[order][min(position, len(vals) - 1)])


def imbalance(per_worker: Sequence[float]) -> float:
    """max / mean over workers; 1.0 when all are equal or all zero."""
    if not per_worker:
        return float("nan")
    mean = sum(per_worker) / len(per_worker)
    return 1.0 if mean == 0 else max(per_worker) / mean


@dataclass(frozen=True, slots=True)
class RunResult:
    """The metrics of one (workload, policy) run. Times in milliseconds unless named otherwise."""

    policy: str
    """The policy's ``name``."""
    workers: int
    requests: int
    hit_rate: float
    """Prompt tokens reused from cache at admission / all prompt tokens."""
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    """Median interval between a sequence's consecutive output tokens, over all tokens."""
    e2e_p99_ms: float
    """Arrival to last token."""
    prefill_imbalance: float
    """Uncached prefill tokens, max / mean over workers."""
    kv_imbalance: float
    """Time-weighted active KV blocks, max / mean over workers."""
    request_imbalance: float
    """Requests routed, max / mean over workers."""
    decision_us_p50: float
    """Wall-clock microseconds inside ``policy.choose`` per request."""
    decision_us_p99: float
    overlap_mae_blocks: float
    """Mean |router's overlap for the chosen worker at routing - blocks the engine reused at admission|."""
    requests_per_worker: tuple[int, ...]
    """Indexed by worker id."""
    prefill_tokens_per_worker: tuple[int, ...]
    """Uncached tokens each worker prefilled (recomputes included)."""
    preemptions: int
    makespan_ms: float
    """Simulated time from the first arrival to the last completion."""
    ttft_ms: tuple[float, ...]
    """Per request, in the order the requests were given (for plots)."""

    def summary(self) -> dict[str, Any]:
        """Every scalar and per-worker figure, JSON-ready (``ttft_ms`` left out)."""
        out: dict[str, Any] = {}
        for item in fields(self):
            if item.name != "ttft_ms":
                value = getattr(self, item.name)
                out[item.name] = list(value) if isinstance(value, tuple) else value
        return out
