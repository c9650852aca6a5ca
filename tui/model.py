"""What ``kvrouter top`` shows, as plain data: one :class:`Snapshot` per refresh, from whichever feed.

The dashboard never talks to a router itself. A feed (``feed.py``: the local shared-memory one, the
HTTP one, or a test's fake) turns what the router publishes into a ``Snapshot``; the app (``app.py``)
keeps the last two to derive rates and renders them. So every screen can be driven, tick by tick, from
data a test writes by hand, and a new source needs only a new feed.

Times are seconds. ``at`` fields are the feed's clock (``time.time()`` for the real feeds), and ages are
computed against the snapshot's ``taken_at``, never against the wall clock inside a widget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

__all__ = [
    "TIERS",
    "Candidate",
    "Decision",
    "Feed",
    "LogEvent",
    "ProbeRow",
    "RouterGone",
    "Shadow",
    "Snapshot",
    "WorkerRow",
]

TIERS: Final = ("device", "host", "disk", "shared")
"""The storage tiers, fastest first: ``kvrouter``'s ``StorageTier`` values in its order (kept apart so the
app imports nothing of the router; ``tests/tui/test_feed.py`` pins the two equal)."""


class RouterGone(Exception):
    """The router the feed follows is not there (never started, stopped, or unreachable)."""


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One (worker, dp rank): what the index holds for it and the load the router booked on it."""

    worker_id: int
    dp_rank: int
    model: str
    state: str
    """``exact``, ``partial``, ``restoring``, ``unknown`` (the event plane's), ``stale`` (silent past its
    timeout), ``approximate`` (no events: approximate mode), ``misconfig`` (the service found a
    misconfiguration: ``problems``) or ``unhealthy`` (taken out of routing)."""
    cached_blocks: int
    active_blocks: int
    prefill_tokens: int
    requests: int
    gaps_detected: int
    gaps_lost: int
    last_event_at: float | None
    """When its last KV event arrived; None if none did."""
    cached_offloaded: tuple[int, int, int] = (0, 0, 0)
    """Blocks the index holds in the host, disk and shared tiers (``TIERS[1:]``); ``cached_blocks`` is the
    device tier's. Kept apart from it rather than as a four-tuple beside it, so the device count cannot be
    given twice and disagree."""
    accuracy: float | None = None
    """The share of the engine's recent reuse reports that matched the router's prediction (the service's
    ``accuracy.py``); None before enough reports."""
    drift: bool = False
    """The accuracy is below the service's drift threshold."""
    problems: tuple[str, ...] = ()
    """The misconfigurations the service found (its ``trust.py``), each a message a person can act on."""
    role: str = "both"
    """The hops it takes in a disaggregated fleet: ``prefill``, ``decode`` or ``both``."""

    @property
    def key(self) -> tuple[int, int]:
        return self.worker_id, self.dp_rank

    @property
    def cached_by_tier(self) -> tuple[int, int, int, int]:
        """Cached blocks per tier, in ``TIERS`` order."""
        return (self.cached_blocks, *self.cached_offloaded)


@dataclass(frozen=True, slots=True)
class Shadow:
    """One shadow policy against the live one over the same decisions (the service's ``shadow.py``)."""

    decisions: float
    agreements: float
    overlap_blocks: float
    live_overlap_blocks: float
    cost: float
    live_cost: float


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker's part in an explained decision (the service's ``explain`` terms)."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prefill_cost: float
    decode_blocks: int
    request_cost: float
    total: float
    probability: float
    selected: bool
    busy: bool
    predicted_blocks: int = 0
    """The predicted tier's blocks: the prompt's, in flight on the worker beyond its events' overlap."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One routing decision, as the router's recent-decisions ring holds it."""

    seq: int
    at: float
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prompt_blocks: int
    cost: float
    decision_us: float
    candidates: tuple[Candidate, ...] = ()
    """Every candidate's terms when the decision was explained, else empty."""


@dataclass(frozen=True, slots=True)
class LogEvent:
    """One entry of the router's event log: a gap, a replay, a shard restart, a registration."""

    seq: int
    at: float
    kind: str
    text: str
    """The entry's other fields, rendered ``key=value``."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The router as one refresh saw it."""

    source: str
    """Where it came from: ``shm:<segment>`` or the URL."""
    taken_at: float
    started_at: float
    """When the router started (its uptime is ``taken_at - started_at``)."""
    shards: int
    shards_up: int
    shards_recovering: int
    events_total: int
    """KV events applied over every shard."""
    queries_total: int
    """Index queries answered (``/query``, the fast path's, the decisions' own walks)."""
    decisions_total: int
    route_p50_us: float | None
    route_p99_us: float | None
    """Decision latency over the router's recent decisions; None before the first."""
    gaps_detected: int
    gaps_recovered: int
    gaps_lost: int
    last_gap_at: float | None
    weights: dict[str, float]
    """The routing weights in effect (``credit``, ``scale``, ``T``, ...), short names, in display order."""
    workers: tuple[WorkerRow, ...]
    decisions: tuple[Decision, ...]
    """The most recent decisions, oldest first."""
    events: tuple[LogEvent, ...]
    """The most recent log entries, oldest first."""
    index_lag_ms: float | None = None
    """How far the index trails the engines' events (None where the source does not say)."""
    replicas: int | None = None
    sync_lag_ms: float | None = None
    """Peers and sync lag with the NATS bridge on; None without it."""
    extra: dict[str, str] = field(default_factory=dict)
    """Anything else the source wants in the header (``model``, ``policy``, ...)."""
    shadows: dict[str, Shadow] = field(default_factory=dict)
    """``--shadow-policy``: each shadow policy's picks against the live ones, by policy name."""
    index_blocks: int | None = None
    """(worker, block) entries in the index, every tier (None where the source does not say)."""
    index_blocks_cap: int = 0
    """The index cap (``--max-index-blocks``) as the shards keep it; 0: no cap."""
    index_evicted: int = 0
    """Entries the cap evicted since the router started, every reason."""


@dataclass(frozen=True, slots=True)
class ProbeRow:
    """A pinned prompt's standing on one worker: its overlap there and what routing it would cost."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    total: float
    busy: bool
    predicted_blocks: int = 0


class Feed(Protocol):
    """A source of snapshots. ``poll`` and ``probe`` block (the app calls them off the UI thread) and
    raise :class:`RouterGone` when the router is not there; the app keeps polling, so a router that
    comes back is picked up again."""

    @property
    def source(self) -> str: ...

    def poll(self) -> Snapshot: ...

    def probe(self, tokens: Sequence[int]) -> tuple[ProbeRow, ...]:
        """Where the prompt ``tokens`` would go now: every worker's overlap and cost, asked of the router
        without booking anything."""
        ...

    def close(self) -> None: ...
