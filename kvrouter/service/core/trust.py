"""Trust: how far the router's picture of each worker's cache can be believed, and misconfigurations named.

Every worker gets one **trust state**, the operator's summary of the event plane's many counters:

- ``exact``: every event accounted for (the plane's stream state ``exact``);
- ``partial``: history lost in a gap or a restart without replay, or not yet restored (``partial``,
  ``restoring``, ``unknown``);
- ``stale``: silent past ``PlaneConfig.stale_after``;
- ``misconfigured``: one of the checks below found something a person must fix.

**Misconfiguration checks**, on every health tick, from what the front already has (the worker's row in
the control segment, the decisions it routed, the engines' reuse reports), each named so a person can act
on it, logged once when found (warning) and once when cleared (info), kept in ``/workers``' ``trust`` and
the events ring, shown in ``kvrouter top``:

- ``block_size``: blocks arrive whose block size differs from the registered one (the plane drops them:
  ``dropped_blocks``, and records the size it saw), so part or all of the worker's cache is invisible;
- ``no_events``: the worker was chosen :data:`NO_EVENTS_DECISIONS` times over at least
  :data:`NO_EVENTS_AFTER_S` seconds since it was registered, and not one KV event arrived on its endpoint
  and topic (the engine publishes elsewhere, under another topic, or not at all);
- ``bad_frames``: every frame from the worker fails to decode under its registered format (wrong
  ``format`` at registration, named when another format decodes them, or another process on that port);
- ``wrong_rank``: another dp rank's batches arrive on this rank's port;
- ``never_reused``: the engine reported the reuse of :data:`NEVER_REUSED_REPORTS` requests for which the
  router predicted cached blocks, and reused none (prefix caching off on the engine, or a different
  block hash: a salt, a LoRA, another tokenizer).

A check clears when its cause stops (no new dropped blocks or bad frames for :data:`CLEAR_AFTER_S`, an
event arrives, a prediction is reused). What contradicts the registration (the size, the format, the
rank) the appliers record in each worker's row (``index/layout.py``'s ``W_SEEN``), where they see it.
Rejected: making misconfigured workers unroutable (a half-seen worker still serves requests; the operator
decides) and wording the messages in the appliers (a message for a person belongs to the process that
talks to one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ...engine import WorkerStats
from ...events.model import WorkerKey
from .counters import ServiceCounters

__all__ = [
    "CLEAR_AFTER_S",
    "NEVER_REUSED_REPORTS",
    "NO_EVENTS_AFTER_S",
    "NO_EVENTS_DECISIONS",
    "TRUST_STATES",
    "Trust",
]

log = logging.getLogger(__name__)

TRUST_STATES: Final = ("exact", "partial", "stale", "misconfigured")
NO_EVENTS_DECISIONS: Final = 20
NO_EVENTS_AFTER_S: Final = 30.0
NEVER_REUSED_REPORTS: Final = 20
CLEAR_AFTER_S: Final = 60.0


@dataclass(slots=True)
class _Seen:
    """What the checks remember of one worker between ticks."""

    registered_at: float
    dropped: int = 0
    bad_frames: int = 0
    dropped_at: float | None = None
    bad_at: float | None = None
    problems: dict[str, str] = field(default_factory=dict)
    """Check name -> the message, while it stands."""


class Trust:
    """Per worker: its trust state and the misconfigurations found, from one tick to the next.

    Args:
        counters: the service's (selections per worker, reuse reports).
        on_change: ``(kind, fields)`` for the events ring when a problem is found or cleared.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        counters: ServiceCounters,
        on_change: Callable[[str, dict[str, Any]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counters = counters
        self._on_change = on_change
        self._clock = clock
        self._seen: dict[WorkerKey, _Seen] = {}
        self.states: dict[WorkerKey, str] = {}

    def registered(self, worker: WorkerKey) -> None:
        self._seen[worker] = _Seen(self._clock())

    def forget(self, worker: WorkerKey) -> None:
        self._seen.pop(worker, None)
        self.states.pop(worker, None)

    def problems(self, worker: WorkerKey) -> dict[str, str]:
        seen = self._seen.get(worker)
        return dict(seen.problems) if seen is not None else {}

    def state(self, worker: WorkerKey) -> str | None:
        return self.states.get(worker)

    def update(
        self, streams: Mapping[WorkerKey, WorkerStats], endpoints: Mapping[WorkerKey, tuple[str, str, int, str]]
    ) -> None:
        """One tick: ``streams`` from the control segment; ``endpoints`` per registered worker its (event
        endpoint, topic, registered block size, format), for the messages."""
        now = self._clock()
        for worker, (endpoint, topic, block_size, fmt) in endpoints.items():
            seen = self._seen.get(worker)
            if seen is None:
                seen = self._seen[worker] = _Seen(now)
            row = streams.get(worker)
            found: dict[str, str] = {}
            if row is not None:
                if row.dropped_blocks > seen.dropped:
                    seen.dropped_at = now
                seen.dropped = row.dropped_blocks
                if seen.dropped_at is not None and now - seen.dropped_at < CLEAR_AFTER_S and row.foreign_block_size:
                    found["block_size"] = (
                        f"worker {_name(worker)} sends KV blocks of {row.foreign_block_size} tokens, registered with "
                        f"block_size {block_size} ({row.dropped_blocks} blocks dropped, not indexed): register it with "
                        f"block_size {row.foreign_block_size}"
                    )
                if row.bad_frames > seen.bad_frames:
                    seen.bad_at = now
                seen.bad_frames = row.bad_frames
                recent = seen.bad_at is not None and now - seen.bad_at < CLEAR_AFTER_S
                if recent and row.foreign_rank is not None and row.foreign_rank != worker[1]:
                    found["wrong_rank"] = (
                        f"dp rank {row.foreign_rank}'s events arrive on {endpoint}, the port of worker "
                        f"{_name(worker)}: check the engine's per-rank ports (base port + dp rank)"
                    )
                elif recent and row.events == 0:
                    guess = (
                        f"they decode as {row.foreign_format}: register it with format {row.foreign_format!r}"
                        if row.foreign_format
                        else "check the format it was registered with"
                    )
                    found["bad_frames"] = (
                        f"worker {_name(worker)}'s frames on {endpoint} do not decode as {fmt} ({row.bad_frames} bad "
                        f"frames, no event applied); {guess}"
                    )
                chosen = self.counters.selections.get(worker, 0)
                if (
                    row.events == 0
                    and row.last_id is None
                    and chosen >= NO_EVENTS_DECISIONS
                    and now - seen.registered_at >= NO_EVENTS_AFTER_S
                ):
                    where = f"{endpoint}" + (f" topic {topic!r}" if topic else "")
                    found["no_events"] = (
                        f"worker {_name(worker)} was chosen {chosen} times in {now - seen.registered_at:.0f} s and no "
                        f"KV event arrived on {where}: check the engine's KV-events endpoint, port and topic"
                    )
            reuse = self.counters.reuse.get(worker)
            if reuse is not None and reuse[4] > 0 and reuse[5] == 0 and reuse[0] - reuse[1] >= NEVER_REUSED_REPORTS:
                found["never_reused"] = (
                    f"the router predicted {reuse[4]} cached prompt tokens on worker {_name(worker)} over "
                    f"{reuse[0]} requests and the engine reused none: is prefix caching off on the engine, or "
                    "are its blocks hashed differently (salt, LoRA, tokenizer)?"
                )
            self._report(worker, seen, found)
            self.states[worker] = _state(row, found)

    def _report(self, worker: WorkerKey, seen: _Seen, found: dict[str, str]) -> None:
        for kind in found.keys() - seen.problems.keys():
            log.warning("misconfigured worker=%s check=%s: %s", _name(worker), kind, found[kind])
            self._on_change(
                "misconfigured", {"worker_id": worker[0], "dp_rank": worker[1], "check": kind, "message": found[kind]}
            )
        for kind in seen.problems.keys() - found.keys():
            log.info("misconfiguration cleared worker=%s check=%s", _name(worker), kind)
            self._on_change("misconfiguration_cleared", {"worker_id": worker[0], "dp_rank": worker[1], "check": kind})
        seen.problems = found


def _state(row: WorkerStats | None, problems: Mapping[str, str]) -> str:
    if problems:
        return "misconfigured"
    if row is None:
        return "partial"
    if row.stale:
        return "stale"
    return "exact" if row.state == "exact" else "partial"


def _name(worker: WorkerKey) -> str:
    return f"{worker[0]}:{worker[1]}"
