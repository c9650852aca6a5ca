"""The operator's choices, apart from the data: sort, filter, pause, pane, cost view, probe, refresh rate.

The app holds one :class:`View` and every key changes it; the widgets read it when they render a
snapshot. Keeping these choices in one plain object (rather than scattered reactives on widgets) is what
lets a Pilot test assert ``app.view.sort_key`` after pressing ``s``, and lets a re-render from the last
snapshot (a key pressed while paused) come out exactly as a fresh poll would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from tui.probe import Probe

__all__ = ["INTERVALS", "SORT_KEYS", "Pane", "View"]

SORT_KEYS: Final = ("worker", "cached", "delta", "active", "prefill", "reqs", "overlap", "cost", "last_event")
"""The order ``s`` cycles through: identity first, then the columns an operator ranks workers by."""

INTERVALS: Final = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
"""The refresh periods ``+`` and ``-`` step through, in seconds; 0.25 (4 Hz, spec §4.1) is the default."""

Pane = Literal["decisions", "events"]


@dataclass(slots=True)
class View:
    """What the operator chose to see."""

    interval: float = 0.25
    """Seconds between polls."""
    paused: bool = False
    """No polls while set; the screen keeps the last snapshot."""
    sort_key: str = "worker"
    """One of :data:`SORT_KEYS`."""
    sort_reverse: bool = False
    """Flip the sort key's natural direction (``S``)."""
    filter: str = ""
    """Only workers whose ``worker:dp state model`` contains this (case-insensitive)."""
    pane: Pane | None = "decisions"
    """The bottom pane; None hides it, for the table's sake on a small terminal."""
    normalised: bool = False
    """Show costs minus the lowest (the winner reads 0, the others their margin) instead of raw (``t``)."""
    probe: Probe | None = None
    """A pinned prompt: the table's overlap and cost columns are its, asked each refresh."""

    @property
    def hertz(self) -> float:
        return 1 / self.interval
