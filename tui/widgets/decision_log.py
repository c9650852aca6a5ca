"""The decision log: the router's recent ``/select``s, newest first, with the runner-up and the margin.

An explained decision (the router explains one at a bounded rate) also lists its cheapest candidates with
their cost, the winner marked ``*``, so the operator sees why a request went where it went; the full
per-term breakdown of the newest explained one is in the worker table's cost columns. The log is rebuilt
every refresh (ages move): it has no cursor to lose.
"""

from __future__ import annotations

from typing import Final

from rich.text import Text
from textual.widgets import DataTable

from tui import cells
from tui.model import Decision

__all__ = ["DecisionLog"]

SHOWN: Final = 50
"""Decisions listed; the router's ring holds more, the pane's height shows fewer."""

CANDIDATES_LISTED: Final = 4


def _candidates(decision: Decision) -> Text:
    ranked = sorted(decision.candidates, key=lambda candidate: candidate.total)[:CANDIDATES_LISTED]
    text = Text()
    for candidate in ranked:
        if text:
            text.append("  ")
        star = "*" if candidate.selected else ""
        text.append(
            f"{candidate.worker_id}:{candidate.dp_rank}{star} ovl {candidate.overlap_blocks} "
            f"cost {cells.cost(candidate.total)}"
        )
    if len(decision.candidates) > CANDIDATES_LISTED:
        text.append(f"  +{len(decision.candidates) - CANDIDATES_LISTED}")
    return text


def _runner_up(decision: Decision) -> float | None:
    others = [candidate.total for candidate in decision.candidates if not candidate.selected]
    return min(others, default=None)


class DecisionLog(DataTable[Text]):
    """Recent decisions; :meth:`show` replaces them."""

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.can_focus = False
        for key, label, width in (
            ("seq", "#", 7),
            ("age", "age", 6),
            ("chosen", "chosen", 7),
            ("overlap", "overlap", 9),
            ("cost", "cost", 8),
            ("runner_up", "runner-up", 9),
            ("us", "µs", 6),
        ):
            self.add_column(Text(label, justify="right"), width=width, key=key)
        self.add_column("candidates (cheapest first, * chosen)", key="candidates")

    def show(self, decisions: tuple[Decision, ...], now: float) -> None:
        self.clear()
        for decision in reversed(decisions[-SHOWN:]):
            runner_up = _runner_up(decision)
            self.add_row(
                cells.number(str(decision.seq)),
                cells.number(cells.age(decision.at, now)),
                cells.number(f"{decision.worker_id}:{decision.dp_rank}"),
                cells.number(f"{decision.overlap_blocks}/{decision.prompt_blocks}"),
                cells.number(cells.cost(decision.cost)),
                cells.number(None if runner_up is None else cells.cost(runner_up)),
                cells.number(f"{decision.decision_us:.0f}"),
                _candidates(decision),
            )
