"""The event log: gaps, replays, shard restarts and registrations, newest first.

Entries whose kind names a loss or a failure are red and those naming a gap, a restart or staleness
yellow (colour for state only, as everywhere on this screen); the rest are plain.
"""

from __future__ import annotations

from typing import Final

from rich.text import Text
from textual.widgets import DataTable

from tui import cells
from tui.model import LogEvent

__all__ = ["EventLog", "kind_style"]

SHOWN: Final = 50


def kind_style(kind: str) -> str:
    """Red for losses and failures, yellow for what is being recovered, plain otherwise."""
    if any(word in kind for word in ("lost", "fail", "died", "unhealthy")):
        return "red"
    if any(word in kind for word in ("gap", "restart", "stale", "recovering")):
        return "yellow"
    return ""


class EventLog(DataTable[Text]):
    """Recent log entries; :meth:`show` replaces them."""

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.can_focus = False
        self.add_column(Text("#", justify="right"), width=7, key="seq")
        self.add_column(Text("age", justify="right"), width=6, key="age")
        self.add_column("kind", width=18, key="kind")
        self.add_column("details", key="text")

    def show(self, events: tuple[LogEvent, ...], now: float) -> None:
        self.clear()
        for event in reversed(events[-SHOWN:]):
            self.add_row(
                cells.number(str(event.seq)),
                cells.number(cells.age(event.at, now)),
                Text(event.kind, style=kind_style(event.kind)),
                Text(event.text),
            )
