"""``Journal``: the service's two rings, what ``GET /events`` and ``GET /decisions`` read.

The events ring holds what changed (a worker registered, skipped, recovered; gaps; shard status; busy
thresholds; the stop), the decisions ring a line per decision (its winner, overlap, cost and, for one
decision every ``EXPLAIN_INTERVAL_S`` or when the client asked, every candidate's terms). Each entry gets
the next number of its ring, so a reader asks for what came after the last number it saw
(``?since=N``) and never misses or repeats one while the ring holds it. Bounded: the oldest go first.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

__all__ = ["Journal"]


class Journal:
    """The events and decisions rings of one service (its event loop is their one writer)."""

    def __init__(self, *, events: int, decisions: int) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=events)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=decisions)
        self.event_seq = 0
        self.decision_seq = 0
        self.last_explained: dict[str, Any] | None = None
        """The most recent decisions-ring entry that carries its candidates (``explain``)."""

    def event(self, kind: str, **fields: Any) -> None:
        """Append an event: ``kind`` and its fields (``key=value``, JSON-able)."""
        self.event_seq += 1
        self.events.append({"seq": self.event_seq, "at": time.time(), "kind": kind, **fields})

    def next_decision(self) -> int:
        """The number the next decision gets (its ``seq``, and its id when the client gave none)."""
        self.decision_seq += 1
        return self.decision_seq

    def decided(self, entry: dict[str, Any]) -> None:
        """Append a decision's entry (numbered by :meth:`next_decision`)."""
        if "explain" in entry:
            self.last_explained = entry
        self.decisions.append(entry)

    @staticmethod
    def after(ring: deque[dict[str, Any]], since: int) -> list[dict[str, Any]]:
        """The entries of ``ring`` numbered above ``since``."""
        return [entry for entry in ring if entry["seq"] > since]
