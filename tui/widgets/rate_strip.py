"""One line of sparklines: events/s, queries/s and decisions/s over the last refreshes.

A row of Textual ``Sparkline`` widgets, each after its label, rather than one custom renderable: the
built-in bars scale per sparkline, so a quiet decisions/s still shows its shape beside a busy events/s.
Both sparkline colours are one neutral shade (``top.tcss``): colour on this screen means state only.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, Sparkline

from tui.rates import METERS, Rates

__all__ = ["RateStrip"]


class RateStrip(Horizontal):
    """Label + sparkline per meter, one line high."""

    DEFAULT_CSS = """
    RateStrip {
        height: 1;
    }
    RateStrip > Label {
        width: auto;
        padding: 0 1 0 0;
    }
    RateStrip > Sparkline {
        width: 1fr;
        margin: 0 2 0 0;
    }
    """

    def compose(self) -> ComposeResult:
        for name in METERS:
            yield Label(f"{name}/s")
            yield Sparkline([], id=f"spark-{name}")

    def show(self, rates: Rates) -> None:
        for name in METERS:
            found = self.query(f"#spark-{name}")  # none while the app tears down and a resize still renders
            if not found:
                return
            sparkline = found.only_one(Sparkline)
            width = max(sparkline.content_size.width, 1)
            past = list(rates.history[name])[-width:]
            # Zeros in front until the history fills the width: bars scroll in from the right, one a
            # refresh, and stand on a zero baseline instead of being stretched across the width.
            sparkline.data = [0.0] * (width - len(past)) + past
