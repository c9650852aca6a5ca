"""Rates from successive snapshots: events/s, queries/s, decisions/s, and each worker's Δcached/s.

The router publishes running totals, not rates: a rate is the difference of two snapshots over the
difference of their ``taken_at``, taken over a window of about two seconds (``WINDOW``) rather than one
refresh: at 4 Hz a router deciding a few times a second moves a total by 0 or 1 per refresh, and its
stats segment is republished at 4 Hz out of phase with the polls, so one-refresh rates flicker between 0
and twice the truth. Deriving it here, from the snapshots the app already holds, keeps the
feeds stateless and makes the rates follow the dashboard's own refresh (pausing, or ``r`` to reset, needs
no cooperation from the router). The cost is that the first snapshot after a start or a reset has no
rate yet; it shows as a dash.

A total that goes down (the router restarted under the same name) is not a negative rate: that interval
yields no rate, and the next one starts from the new totals.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from tui.model import Snapshot

__all__ = ["HISTORY", "METERS", "WINDOW", "Rates"]

METERS: Final = ("events", "queries", "decisions")
"""The header's rates, each from the snapshot's ``<name>_total``."""

WINDOW: Final = 2.0
"""Seconds a rate spans: from the newest snapshot at least this old (or the oldest kept) to the latest."""
HISTORY: Final = 120
"""Rates kept per meter for the sparklines: 30 s at the default 4 Hz, wider than any sparkline's room."""


class Rates:
    """The rates over the last ``window`` seconds of the snapshots it was given, and a bounded history of
    each."""

    def __init__(self, history: int = HISTORY, window: float = WINDOW) -> None:
        self._history = history
        self._window = window
        self._past: deque[Snapshot] = deque()
        """The snapshots the rates span, oldest first."""
        self.current: dict[str, float | None] = dict.fromkeys(METERS)
        """Each meter's rate over the last interval; None before there are two snapshots."""
        self.history: dict[str, deque[float]] = {name: deque(maxlen=history) for name in METERS}
        """Each meter's past rates, oldest first."""
        self.cached: dict[tuple[int, int], float] = {}
        """Δcached/s per (worker, dp rank) over the last interval; absent for a worker new in it."""
        self.cached_history: dict[tuple[int, int], deque[float]] = {}
        """Each worker's past Δcached/s, oldest first (the detail view's sparkline)."""

    def update(self, snapshot: Snapshot) -> None:
        """Take the next snapshot; rates come from it and the oldest one of the window."""
        past = self._past
        if past and snapshot.taken_at <= past[-1].taken_at:
            return
        if past and snapshot.started_at != past[-1].started_at:  # another router: nothing to difference
            self.current = dict.fromkeys(METERS)
            self.cached = {}
            past.clear()
        past.append(snapshot)
        while len(past) > 2 and snapshot.taken_at - past[1].taken_at >= self._window:
            past.popleft()
        if len(past) < 2:
            return
        first = past[0]
        elapsed = snapshot.taken_at - first.taken_at
        went_down = False
        for name in METERS:
            now = getattr(snapshot, f"{name}_total")
            before = getattr(first, f"{name}_total")
            per_second = (now - before) / elapsed if now >= before else None
            went_down |= per_second is None
            self.current[name] = per_second
            if per_second is not None:
                self.history[name].append(per_second)
        before_cached = {row.key: row.cached_blocks for row in first.workers}
        self.cached = {
            row.key: (row.cached_blocks - before_cached[row.key]) / elapsed
            for row in snapshot.workers
            if row.key in before_cached
        }
        for key, per_second in self.cached.items():
            self.cached_history.setdefault(key, deque(maxlen=self._history)).append(per_second)
        if went_down:  # the next rates start from the new totals
            while len(past) > 1:
                past.popleft()

    def reset(self) -> None:
        """Forget everything: the next snapshot starts the rates afresh (the ``r`` key)."""
        self._past.clear()
        self.current = dict.fromkeys(METERS)
        for past in self.history.values():
            past.clear()
        self.cached = {}
        self.cached_history = {}
