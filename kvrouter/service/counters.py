"""``ServiceCounters``: what the service counts on its event loop, for ``metrics.py`` to read at scrape time.

Plain integers and :class:`~kvrouter.service.histogram.Buckets` in one dataclass, mutated only by the
event loop, so nothing is locked: a scrape runs on that same loop. Kept apart from ``app.py`` because
three modules write to it (the service's decisions, the HTTP middleware, the router queue) and one
reads it (``metrics.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from ..events.model import WorkerKey
from .histogram import HIT_RATE_BUCKETS, Buckets

__all__ = ["PHASES", "ServiceCounters"]

PHASES: Final = ("parse", "hash", "decide", "serialise", "total")
"""Where a ``/select``'s time goes (``ServiceCounters.phases``): the body read, decoded and validated; the
tokens hashed to blocks; the decision (``Router.select``: index walk, costs, choice); the answer built
and encoded; and the whole handler."""


@dataclass(slots=True)
class ServiceCounters:
    """What the service counts, read at scrape time by ``metrics.py``. Mutated by the event loop only."""

    decisions: int = 0
    reservations: int = 0
    """``/select_and_reserve`` decisions."""
    selections: dict[WorkerKey, int] = field(default_factory=dict)
    """Decisions per chosen (worker_id, dp_rank)."""
    overlap_blocks: int = 0
    """Sum over decisions of the chosen worker's device overlap in blocks."""
    prompt_blocks: int = 0
    """Sum over decisions of the prompt's full blocks: ``overlap_blocks / prompt_blocks`` is the hit rate."""
    overloaded: int = 0
    """Requests refused because every candidate was over a busy threshold."""
    no_worker: int = 0
    """Requests refused because the partition had no schedulable worker."""
    expired_reservations: int = 0
    decision: Buckets = field(default_factory=Buckets)
    """Seconds per decision (``Router.select``)."""
    hit_rate: Buckets = field(default_factory=lambda: Buckets(HIT_RATE_BUCKETS))
    """Per decision, the chosen worker's predicted overlap over the prompt's blocks."""
    phases: dict[str, Buckets] = field(default_factory=lambda: {phase: Buckets() for phase in PHASES})
    """Seconds per phase of a ``/select`` (``PHASES``)."""
    http_requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(route, method) -> requests."""
    http_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    """(route, "4xx" | "5xx") -> answers."""
    http_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    """(route, method) -> total seconds spent answering."""
