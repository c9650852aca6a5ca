"""How one value reads on the dashboard: short numbers, ages, durations, and the state colours.

Every widget formats through these functions, so a number reads the same in the header, the table and
the logs (``12.3k``, ``850``, ``0.21 ms``, ``37s``). Numbers come back as right-justified ``rich`` Text
(spec §4.1: numbers right-aligned); colour is used only for state (red = failed or gap, yellow = stale
or pending), never to decorate a number, so the screen reads the same with ``NO_COLOR``.
"""

from __future__ import annotations

from typing import Final

from rich.text import Text

__all__ = [
    "DASH",
    "STATE_STYLES",
    "age",
    "cost",
    "count",
    "duration",
    "latency_us",
    "number",
    "rate",
    "signed_rate",
    "state",
]

DASH: Final = "-"
"""What a cell shows when the value is not known (no event yet, no decision explained yet)."""

STATE_STYLES: Final[dict[str, str]] = {
    "unhealthy": "bold red",
    "misconfig": "bold red",
    "failed": "bold red",
    "stale": "yellow",
    "restoring": "yellow",
    "partial": "yellow",
    "unknown": "yellow",
    "pending": "yellow",
}
"""A worker state's colour; states not listed (``exact``, ``approximate``) stay plain."""


def count(value: float) -> str:
    """A count in at most five characters: ``850``, ``12.3k``, ``4.1M``."""
    magnitude = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            scaled = value / limit
            return f"{scaled:.1f}{suffix}" if abs(scaled) < 100 else f"{scaled:.0f}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() or magnitude >= 10 else f"{value:.1f}"


def rate(per_second: float | None) -> str:
    """A rate as ``12.3k/s``; a dash before there are two snapshots to derive it from."""
    return DASH if per_second is None else f"{count(per_second)}/s"


def signed_rate(per_second: float | None) -> str:
    """A change per second with its sign (``+12``, ``-3.5``, ``0``): the table's Δcached/s."""
    if per_second is None:
        return DASH
    if per_second == 0:
        return "0"
    return ("+" if per_second > 0 else "") + count(per_second)


def cost(value: float | None) -> str:
    """A routing cost with one decimal (``40.5``), or short past 10k (``12.3k``)."""
    if value is None:
        return DASH
    return f"{value:.1f}" if abs(value) < 10_000 else count(value)


def duration(seconds: float) -> str:
    """A span of time in at most six characters: ``0.3s``, ``37s``, ``12m04s``, ``3h12m``, ``2d04h``."""
    seconds = max(seconds, 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def age(at: float | None, now: float) -> str:
    """How long ago ``at`` was, against the snapshot's own ``taken_at`` (never the wall clock)."""
    return DASH if at is None else duration(now - at)


def latency_us(micros: float | None) -> str:
    """A decision latency in milliseconds, two decimals under 10 ms: ``0.21``."""
    if micros is None:
        return DASH
    millis = micros / 1000
    return f"{millis:.2f}" if millis < 10 else f"{millis:.0f}"


def number(value: str | float | int | None, *, style: str = "") -> Text:
    """A table cell holding a number: right-justified, a dash when unknown."""
    if value is None:
        shown = DASH
    elif isinstance(value, str):
        shown = value
    else:
        shown = count(value)
    return Text(shown, style=style, justify="right")


def state(name: str) -> Text:
    """A worker's state, coloured when it needs attention."""
    return Text(name, style=STATE_STYLES.get(name, ""))
