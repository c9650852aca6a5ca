"""The screens over the dashboard: router not there, help, worker detail, probe prompt.

The not-there screen is a full screen pushed over the dashboard, not a message in the header: when the
router is gone nothing on the dashboard is current, and leaving stale numbers on view invites reading
them. The app pops it at the first poll that succeeds. The others are modal and close with ``escape``.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Sparkline, Static

from tui import cells
from tui.model import TIERS, Snapshot
from tui.probe import Probe, read_probe
from tui.rates import Rates
from tui.widgets.worker_table import row_key

__all__ = ["DetailScreen", "HelpScreen", "NotThereScreen", "ProbeScreen"]

KEYS = (
    ("q", "quit"),
    ("p / space", "pause / resume polling"),
    ("s / S", "cycle the sort key / reverse it"),
    ("/", "filter workers (enter keeps it, escape clears it)"),
    ("enter", "worker detail"),
    ("e / d", "event log / decision log pane (again: hide)"),
    ("r", "reset the rate counters"),
    ("+ / -", "refresh faster / slower"),
    ("t", "costs raw / minus the lowest"),
    ("i", "pin a probe prompt (token ids, or a file of them)"),
    ("?", "this help"),
    ("ctrl+p", "command palette"),
)
"""The key table of spec §4.1 plus the probe, as the help screen lists it."""


class NotThereScreen(Screen[None]):
    """Says the router is not there, what the last attempt said, and that polling goes on."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.attempts = 0
        """Failed polls since the router went."""
        self.error = ""
        """What the last failed poll raised, as one line."""
        self.since = self.last_attempt = 0.0
        self.interval = 0.0
        self._text = Static(id="not-there-text")
        """Made here, not in ``compose``: a report may come before the screen's children are mounted (a
        query for them then fails), and a Static takes its content before it is mounted too."""

    def compose(self) -> ComposeResult:
        with Vertical(id="not-there"):
            yield self._text
        yield Footer()

    def report(self, error: str, *, since: float, now: float, interval: float) -> None:
        """One more failed poll: ``error`` is what it raised, ``since`` when polls began to fail."""
        self.attempts += 1
        self.error = error
        self.since, self.last_attempt, self.interval = since, now, interval
        self._show()

    def _show(self) -> None:
        attempts = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
        text = Text.assemble(
            ("router not there", "bold red"),
            f" — retrying every {self.interval:g}s\n\n",
            ("source  ", "dim"),
            f"{self.source}\n",
            ("error   ", "dim"),
            f"{self.error}\n",
            ("since   ", "dim"),
            f"{cells.duration(self.last_attempt - self.since)} ago, {attempts}\n\n",
            "The dashboard comes back by itself when the router answers again.  q quits.",
        )
        self._text.update(text)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        lines = Text()
        lines.append("kvrouter top — keys\n", style="bold")
        for key, action in KEYS:
            lines.append(f"{key:>10}  ", style="bold")
            lines.append(f"{action}\n")
        lines.append(
            "\nColour is state only: red = failed or gap lost, yellow = stale, pending.\n"
            "▶ marks the winner of the decision whose overlap and costs the rows show\n"
            "(or the pinned probe prompt's).  escape closes."
        )
        yield Static(lines, id="help")


class DetailScreen(ModalScreen[None]):
    """One worker: every field, its Δcached/s history, and what the recent decisions did with it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,enter", "dismiss", "close")]

    def __init__(self, key: tuple[int, int]) -> None:
        super().__init__()
        self.key = key

    def compose(self) -> ComposeResult:
        with Vertical(id="detail"):
            yield Static(id="detail-text")
            yield Static("Δcached/s", classes="caption")
            yield Sparkline([], id="detail-spark")

    def show(self, snapshot: Snapshot, rates: Rates) -> None:
        row = next((row for row in snapshot.workers if row.key == self.key), None)
        text = Text()
        text.append(f"worker {row_key(self.key)}\n\n", style="bold")
        if row is None:
            text.append("no longer in the router's worker list")
        else:
            won = [d for d in snapshot.decisions if (d.worker_id, d.dp_rank) == self.key]
            fields = (
                ("model", row.model),
                ("role", row.role),
                ("state", row.state),
                *(  # one line per tier, device (the cached column) first
                    ("cached blocks" if tier == TIERS[0] else "", f"{count} {tier}")
                    for tier, count in zip(TIERS, row.cached_by_tier, strict=True)
                ),
                ("Δcached/s", cells.signed_rate(rates.cached.get(self.key))),
                ("active blocks", str(row.active_blocks)),
                ("prefill tokens", str(row.prefill_tokens)),
                ("requests", str(row.requests)),
                ("gaps", f"{row.gaps_detected} detected, {row.gaps_lost} lost"),
                ("index accuracy", _accuracy(row.accuracy, row.drift)),
                ("last event", f"{cells.age(row.last_event_at, snapshot.taken_at)} ago"),
                ("recent decisions", f"chose it {len(won)} of {len(snapshot.decisions)}"),
            )
            for name, value in fields:
                text.append(f"{name:>16}  ", style="dim")
                text.append(value, style=cells.STATE_STYLES.get(value, ""))
                text.append("\n")
            for problem in row.problems:
                text.append(f"{'misconfigured':>16}  ", style="dim")
                text.append(problem + "\n", style="bold red")
            if won:
                overlaps = [d.overlap_blocks / d.prompt_blocks for d in won if d.prompt_blocks]
                if overlaps:
                    text.append(f"{'overlap (won)':>16}  ", style="dim")
                    text.append(f"{100 * sum(overlaps) / len(overlaps):.0f}% of the prompt on average\n")
        self.query_one("#detail-text", Static).update(text)
        self.query_one("#detail-spark", Sparkline).data = list(rates.cached_history.get(self.key, ()))


def _accuracy(share: float | None, drift: bool) -> str:
    """The engine's reuse reports against the router's predictions (the service's ``accuracy.py``)."""
    if share is None:
        return "not enough reuse reports yet"
    return f"{100 * share:.0f}% of recent reuse reports as predicted" + (" (DRIFT)" if drift else "")


class ProbeScreen(ModalScreen[Probe | None]):
    """Asks for a prompt to pin. Enter with token ids or a path pins it; enter on an empty line unpins
    (dismisses with None); escape leaves things as they were."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.pop_screen", "cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="probe"):
            yield Static(
                "Pin a probe prompt: token ids (1 2 3, or [1, 2, 3]) or the path of a file of them.\n"
                "Enter on an empty line unpins; escape cancels."
            )
            yield Input(placeholder="token ids or a file", id="probe-input")
            yield Static(id="probe-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if not event.value.strip():
            self.dismiss(None)
            return
        try:
            probe = read_probe(event.value)
        except ValueError as exc:
            self.query_one("#probe-error", Static).update(Text(str(exc), style="red"))
            return
        self.dismiss(probe)
