"""``ServiceCounters``: what the service counts on its event loop, for ``metrics.py`` to read at scrape time.

Plain integers and :class:`~kvrouter.service.histogram.Buckets` in one dataclass, mutated only by the
event loop, so nothing is locked: a scrape runs on that same loop. Kept apart from ``app.py`` because
three modules write to it (the service's decisions, the HTTP middleware, the router queue) and one
reads it (``metrics.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from ...events.model import WorkerKey
from .histogram import HIT_RATE_BUCKETS, REUSE_ERROR_BUCKETS, Buckets

__all__ = ["PHASES", "PREDICTION_FIELDS", "REUSE_FIELDS", "SHADOW_FIELDS", "ServiceCounters"]

PHASES: Final = ("parse", "hash", "decide", "serialise", "total")
"""Where a ``/select``'s time goes (``ServiceCounters.phases``): the body read, decoded and validated; the
tokens hashed to blocks; the decision (``Router.select``: index walk, costs, choice); the answer built
and encoded; and all of it, from the body read to the encoded answer."""
REUSE_FIELDS: Final = ("reports", "exact", "over", "under", "predicted_tokens", "actual_tokens")
"""``ServiceCounters.reuse``'s per-worker figures, in order (``accuracy.py``)."""
PREDICTION_FIELDS: Final = ("made", "confirmed", "contradicted", "expired")
"""``ServiceCounters.predictions``' per-worker counts, in order (``predictions.py``)."""
_SUMMED: Final = ("decisions", "reservations", "overlap_blocks", "prompt_blocks", "overloaded", "no_worker",
                  "expired_reservations", "connections", "handovers", "shared_failures")  # fmt: skip
"""The plain integer counts :meth:`ServiceCounters.add` sums."""
SHADOW_FIELDS: Final = ("decisions", "agreements", "overlap_blocks", "live_overlap_blocks", "cost", "live_cost")
"""``ServiceCounters.shadow``'s per-policy sums, in order (``shadow.py``): ``cost`` and ``live_cost`` over the
decisions whose shadow pick was a live candidate."""


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
    connections: int = 0
    """HTTP connections accepted (with ``--fronts N``, counted once: by front 0, which accepts them all)."""
    handovers: int = 0
    """Connections the hot lane gave to aiohttp (``lane.py``): their first request was not one it takes."""
    shared_failures: int = 0
    """Connections a front closed because serving its share of them raised (``sharing.py``; logged each)."""
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
    reuse: dict[WorkerKey, list[int]] = field(default_factory=dict)
    """Per worker, the engine's reuse reports against the router's predictions (``REUSE_FIELDS``)."""
    reuse_error: dict[WorkerKey, Buckets] = field(default_factory=dict)
    """Per worker, blocks reused minus blocks predicted (``REUSE_ERROR_BUCKETS``)."""
    predictions: dict[WorkerKey, list[int]] = field(default_factory=dict)
    """Per worker, the predicted tier's bets and how they ended (``PREDICTION_FIELDS``)."""
    shadow: dict[str, list[float]] = field(default_factory=dict)
    """Per shadow policy, its choices against the live ones (``SHADOW_FIELDS``)."""

    def to_wire(self) -> dict[str, Any]:
        """JSON-able, for the other fronts of ``--fronts N`` (``fronts.py``), which sum every front's."""
        return {
            "decisions": self.decisions,
            "reservations": self.reservations,
            "selections": [[k[0], k[1], n] for k, n in self.selections.items()],
            "overlap_blocks": self.overlap_blocks,
            "prompt_blocks": self.prompt_blocks,
            "overloaded": self.overloaded,
            "no_worker": self.no_worker,
            "expired_reservations": self.expired_reservations,
            "connections": self.connections,
            "handovers": self.handovers,
            "shared_failures": self.shared_failures,
            "decision": self.decision.to_wire(),
            "hit_rate": self.hit_rate.to_wire(),
            "phases": {name: b.to_wire() for name, b in self.phases.items()},
            "http_requests": [[*k, n] for k, n in self.http_requests.items()],
            "http_errors": [[*k, n] for k, n in self.http_errors.items()],
            "http_seconds": [[*k, s] for k, s in self.http_seconds.items()],
            "reuse": _counts_to_wire(self.reuse),
            "reuse_error": [[k[0], k[1], b.to_wire()] for k, b in self.reuse_error.items()],
            "predictions": _counts_to_wire(self.predictions),
            "shadow": self.shadow,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ServiceCounters:
        """Raises: KeyError, TypeError, ValueError: not what :meth:`to_wire` makes."""
        return cls(
            decisions=int(wire["decisions"]),
            reservations=int(wire["reservations"]),
            selections={(int(w), int(r)): int(n) for w, r, n in wire["selections"]},
            overlap_blocks=int(wire["overlap_blocks"]),
            prompt_blocks=int(wire["prompt_blocks"]),
            overloaded=int(wire["overloaded"]),
            no_worker=int(wire["no_worker"]),
            expired_reservations=int(wire["expired_reservations"]),
            connections=int(wire["connections"]),
            handovers=int(wire["handovers"]),
            shared_failures=int(wire["shared_failures"]),
            decision=Buckets.from_wire(wire["decision"]),
            hit_rate=Buckets.from_wire(wire["hit_rate"], HIT_RATE_BUCKETS),
            phases={str(name): Buckets.from_wire(b) for name, b in wire["phases"].items()},
            http_requests={(str(a), str(b)): int(n) for a, b, n in wire["http_requests"]},
            http_errors={(str(a), str(b)): int(n) for a, b, n in wire["http_errors"]},
            http_seconds={(str(a), str(b)): float(s) for a, b, s in wire["http_seconds"]},
            reuse=_counts_from_wire(wire["reuse"], len(REUSE_FIELDS)),
            reuse_error={
                (int(w), int(r)): Buckets.from_wire(b, REUSE_ERROR_BUCKETS) for w, r, b in wire["reuse_error"]
            },
            predictions=_counts_from_wire(wire["predictions"], len(PREDICTION_FIELDS)),
            shadow={
                str(name): [float(v) for v in values]
                for name, values in wire["shadow"].items()
                if len(values) == len(SHADOW_FIELDS)
            },
        )

    def add(self, other: ServiceCounters) -> None:
        """Add ``other``'s counts to these (every figure here is a sum over decisions or requests)."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        _add(self.selections, other.selections)
        _add(self.http_requests, other.http_requests)
        _add(self.http_errors, other.http_errors)
        _add(self.http_seconds, other.http_seconds)
        _add_counts(self.reuse, other.reuse, len(REUSE_FIELDS))
        _add_counts(self.predictions, other.predictions, len(PREDICTION_FIELDS))
        for key, buckets in other.reuse_error.items():
            self.reuse_error.setdefault(key, Buckets(REUSE_ERROR_BUCKETS)).add(buckets)
        for name, values in other.shadow.items():
            mine_shadow = self.shadow.setdefault(name, [0.0] * len(SHADOW_FIELDS))
            for i, value in enumerate(values):
                mine_shadow[i] += value
        self.decision.add(other.decision)
        self.hit_rate.add(other.hit_rate)
        for phase, buckets in other.phases.items():
            self.phases.setdefault(phase, Buckets()).add(buckets)


_K = TypeVar("_K")
_V = TypeVar("_V", int, float)


def _counts_to_wire(table: dict[WorkerKey, list[int]]) -> list[list[int]]:
    """A per-worker table of counts (``reuse``, ``predictions``) as ``[worker_id, dp_rank, count...]`` rows."""
    return [[key[0], key[1], *counts] for key, counts in table.items()]


def _counts_from_wire(rows: list[list[Any]], width: int) -> dict[WorkerKey, list[int]]:
    """:func:`_counts_to_wire`'s rows back; a row of another width (another version's fields) is left out."""
    return {(int(r[0]), int(r[1])): [int(c) for c in r[2:]] for r in rows if len(r) == 2 + width}


def _add_counts(mine: dict[WorkerKey, list[int]], theirs: dict[WorkerKey, list[int]], width: int) -> None:
    for key, counts in theirs.items():
        sums = mine.setdefault(key, [0] * width)
        for i, count in enumerate(counts):
            sums[i] += count


def _add(mine: dict[_K, _V], theirs: dict[_K, _V]) -> None:
    for key, value in theirs.items():
        mine[key] = mine[key] + value if key in mine else value
