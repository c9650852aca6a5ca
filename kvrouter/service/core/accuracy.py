"""Index accuracy on live traffic: the overlap the router predicted for the chosen worker against the prompt
tokens the engine says it actually reused.

Every other router reports only what it predicted; whether the index still tells the truth about the
engines' caches shows only as a hit rate that sinks for reasons nobody can see. A reservation remembers
its prediction (the chosen worker's device overlap, in tokens); the engine's own figure comes back with
the answer (``usage.prompt_tokens_details.cached_tokens`` in OpenAI-compatible answers, which the proxy
reads from the answer's end) or from a client that sends ``{"cached_tokens": n}`` with
``prefill_complete``. Each report is classed in whole blocks:

- ``exact``: the same number of blocks;
- ``over``: the router predicted blocks the engine did not have (stale entries: removals lost, a restart
  missed, an eviction not yet seen);
- ``under``: the engine reused blocks the router did not know of (stores lost, or a prefix another
  in-flight request put there since the decision).

Per worker: the counts and token sums (``ServiceCounters.reuse``), a histogram of actual minus predicted in
blocks (``ServiceCounters.reuse_error``), both summed over the fronts of ``--fronts N``; and the share of
``exact`` over the last :data:`WINDOW` reports on this front, which raises a **drift warning** (logged
once per episode, an ``accuracy_drift`` event in ``/events``, ``drift`` in ``/workers``) when it falls
below :data:`DRIFT_BELOW` with at least :data:`MIN_REPORTS` reports in the window, and clears when it
comes back. Rejected: comparing token counts without classing (an engine recomputing the last block of a
fully cached prompt would read as an error of one token) and a lifetime share for the warning (a worker
right for an hour and wrong for the last minute would never warn).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from ...events.model import WorkerKey
from .counters import REUSE_FIELDS, ServiceCounters
from .histogram import REUSE_ERROR_BUCKETS, Buckets

__all__ = ["DRIFT_BELOW", "MIN_REPORTS", "WINDOW", "Accuracy"]

log = logging.getLogger(__name__)

WINDOW: Final = 100
"""Reports per worker the drift check looks at."""
MIN_REPORTS: Final = 20
"""A worker is judged only with this many reports in its window."""
DRIFT_BELOW: Final = 0.8
"""A rolling share of ``exact`` below this is a drift. The mock engines, routed by kvrouter with every event
seen, stay above 0.95 in the tests (concurrent requests sharing a new prefix are the usual ``under``)."""


class Accuracy:
    """Per worker: classes each report, keeps the rolling window, raises and clears drift.

    Args:
        counters: where the lifetime counts go (the service's, summed over fronts).
        on_change: called with ``(kind, fields)`` when a worker starts or stops drifting (the service's
            event ring).
    """

    def __init__(self, counters: ServiceCounters, on_change: Callable[[str, dict[str, Any]], None]) -> None:
        self.counters = counters
        self._on_change = on_change
        self._window: dict[WorkerKey, deque[int]] = {}
        """Per worker, the last reports' outcomes: 0 exact, 1 over, 2 under."""
        self.drifting: set[WorkerKey] = set()

    def observe(self, worker: WorkerKey, predicted_tokens: int, actual_tokens: int, block_size: int) -> str:
        """One report; returns its outcome (``exact``, ``over`` or ``under``)."""
        predicted, actual = predicted_tokens // block_size, actual_tokens // block_size
        outcome = 0 if predicted == actual else 1 if predicted > actual else 2
        counts = self.counters.reuse.setdefault(worker, [0] * len(REUSE_FIELDS))
        counts[0] += 1
        counts[1 + outcome] += 1
        counts[4] += predicted_tokens
        counts[5] += actual_tokens
        errors = self.counters.reuse_error.get(worker)
        if errors is None:
            errors = self.counters.reuse_error[worker] = Buckets(REUSE_ERROR_BUCKETS)
        errors.observe(actual - predicted)
        window = self._window.get(worker)
        if window is None:
            window = self._window[worker] = deque(maxlen=WINDOW)
        window.append(outcome)
        self._judge(worker, window)
        return ("exact", "over", "under")[outcome]

    def rolling(self, worker: WorkerKey) -> float | None:
        """The share of ``exact`` over the worker's window; None before :data:`MIN_REPORTS` reports."""
        window = self._window.get(worker)
        if window is None or len(window) < MIN_REPORTS:
            return None
        return window.count(0) / len(window)

    def view(self, worker: WorkerKey) -> dict[str, Any] | None:
        """``/workers``' ``accuracy`` of one rank: lifetime counts (every front's) and this front's window."""
        counts = self.counters.reuse.get(worker)
        if counts is None:
            return None
        answer: dict[str, Any] = dict(zip(REUSE_FIELDS, counts, strict=True))
        answer["rolling"] = self.rolling(worker)
        answer["drift"] = worker in self.drifting
        return answer

    def forget(self, worker: WorkerKey) -> None:
        """The rank is unregistered: its window and drift go (its lifetime counts stay in the counters)."""
        self._window.pop(worker, None)
        self.drifting.discard(worker)

    def _judge(self, worker: WorkerKey, window: deque[int]) -> None:
        if len(window) < MIN_REPORTS:
            return
        share = window.count(0) / len(window)
        fields = {
            "worker_id": worker[0],
            "dp_rank": worker[1],
            "accuracy": round(share, 3),
            "over": window.count(1),
            "under": window.count(2),
            "reports": len(window),
        }
        if share < DRIFT_BELOW and worker not in self.drifting:
            self.drifting.add(worker)
            side = (
                "over (the index holds blocks the engine has not)"
                if fields["over"] >= fields["under"]
                else ("under (the engine holds blocks the index has not)")
            )
            log.warning(
                "index accuracy drift worker=%d dp=%d accuracy=%.2f over=%d under=%d reports=%d: mostly %s",
                worker[0],
                worker[1],
                share,
                fields["over"],
                fields["under"],
                len(window),
                side,
            )
            self._on_change("accuracy_drift", fields)
        elif share >= DRIFT_BELOW and worker in self.drifting:
            self.drifting.discard(worker)
            log.info("index accuracy recovered worker=%d dp=%d accuracy=%.2f", worker[0], worker[1], share)
            self._on_change("accuracy_recovered", fields)
