"""The header: every meter of spec §4.1, flowed into as many lines as the terminal's width needs.

Meters are short groups (``events 12.3k/s``, ``route p50/p99 0.21/0.90 ms``) that must not break in the
middle, so this widget lays them out itself, greedily, a group per slot, instead of handing one long
string to Rich's word wrap (which would split ``events`` from its number at 80 columns). Three lines
at 200 columns, four or five at 80.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from tui import cells
from tui.model import Shadow, Snapshot
from tui.rates import Rates
from tui.view import View

__all__ = ["Meters", "Status", "header_groups"]

_GAP = "  "


@dataclass(frozen=True, slots=True)
class Status:
    """The app's side of the header: how old the data is and what the operator chose."""

    now: float
    """The injected clock's reading when the header was last refreshed."""
    stale_after: float
    """Seconds past the last snapshot's ``taken_at`` after which the data is flagged stale."""
    view: View
    probe_error: str | None = None
    """What the last probe raised, if it did."""
    sort_shown: bool = True
    """The sort key's column is on screen (and carries the arrow); else the header names the sort."""


def _weights(weights: dict[str, float]) -> str:
    return " ".join(f"{name} {value:g}" for name, value in weights.items())


def _shadow(name: str, shadow: Shadow) -> Text:
    """``shadow greedy_overlap agree 72% ovl 81/79% cost +3%``: the shadow's picks against the live ones, over
    the same decisions (overlap shown the shadow's / the live's; cost the live cost function's)."""
    if not shadow.decisions:
        return Text(f"shadow {name} -")
    agree = 100 * shadow.agreements / shadow.decisions
    text = f"shadow {name} agree {agree:.0f}%"
    if shadow.live_overlap_blocks:
        text += f" ovl {100 * shadow.overlap_blocks / shadow.live_overlap_blocks:.0f}% of live"
    if shadow.live_cost:
        text += f" cost {100 * (shadow.cost - shadow.live_cost) / shadow.live_cost:+.0f}%"
    return Text(text)


def _index_use(snapshot: Snapshot) -> Text:
    """``index 1.2M/8.4M blocks, 3.1k evicted``: the cap's use, yellow once it evicts (the index then
    holds less than the caches)."""
    blocks = cells.count(snapshot.index_blocks or 0)
    text = Text(
        f"index {blocks}/{cells.count(snapshot.index_blocks_cap)} blocks"
        if snapshot.index_blocks_cap
        else f"index {blocks} blocks"
    )
    if snapshot.index_evicted:
        text.append(f", {cells.count(snapshot.index_evicted)} evicted", style="yellow")
    return text


def header_groups(snapshot: Snapshot, rates: Rates, status: Status) -> list[Text]:
    """The meters, in reading order; each is kept whole on one line."""
    view = status.view
    groups: list[Text] = [Text(snapshot.source, style="bold")]
    groups += [Text(f"{name} {value}") for name, value in snapshot.extra.items()]
    groups.append(Text(f"up {cells.duration(snapshot.taken_at - snapshot.started_at)}"))

    shards = Text(f"shards {snapshot.shards_up}/{snapshot.shards}")
    if snapshot.shards_recovering:
        shards.append(f" ({snapshot.shards_recovering} recovering)", style="yellow")
    if snapshot.shards_up < snapshot.shards:
        shards.stylize("bold red")
    else:
        shards.append(" ok")
    groups.append(shards)

    flagged = sum(1 for row in snapshot.workers if row.state in cells.STATE_STYLES)
    workers = Text(f"workers {len(snapshot.workers) - flagged}/{len(snapshot.workers)} ok")
    if flagged:
        workers.stylize("yellow")
    groups.append(workers)

    if view.paused:
        groups.append(Text(" PAUSED ", style="reverse bold"))
    else:
        data_age = status.now - snapshot.taken_at
        if data_age > status.stale_after:
            groups.append(Text(f"stale {cells.duration(data_age)}", style="bold yellow"))
        else:
            groups.append(Text(f"{view.hertz:g} Hz, age {cells.duration(data_age)}"))

    groups += [Text(f"{name} {cells.rate(rates.current[name])}") for name in ("events", "queries", "decisions")]
    groups.append(
        Text(f"route p50/p99 {cells.latency_us(snapshot.route_p50_us)}/{cells.latency_us(snapshot.route_p99_us)} ms")
    )
    if snapshot.index_lag_ms is not None:
        groups.append(Text(f"index lag {snapshot.index_lag_ms:.0f} ms"))
    if snapshot.index_blocks is not None:
        groups.append(_index_use(snapshot))

    gaps = Text(f"gaps {snapshot.gaps_detected}")
    if snapshot.gaps_detected:
        gaps.append(f" ({snapshot.gaps_recovered} recovered, {snapshot.gaps_lost} lost)")
        if snapshot.last_gap_at is not None:
            gaps.append(f" last {cells.age(snapshot.last_gap_at, snapshot.taken_at)} ago")
        if snapshot.gaps_lost:
            gaps.stylize("red")
    groups.append(gaps)
    if snapshot.replicas is not None:
        lag = "" if snapshot.sync_lag_ms is None else f", sync lag {snapshot.sync_lag_ms:.0f} ms"
        groups.append(Text(f"replicas {snapshot.replicas}{lag}"))
    if snapshot.weights:
        groups.append(Text(f"weights {_weights(snapshot.weights)}"))
    groups += [_shadow(name, shadow) for name, shadow in sorted(snapshot.shadows.items())]

    if not status.sort_shown:
        groups.append(Text(f"sort {view.sort_key}{'▲' if view.sort_reverse else '▼'}"))
    if view.filter:
        groups.append(Text(f"filter {view.filter!r}"))
    if view.normalised:
        groups.append(Text("costs minus min"))
    if view.probe is not None:
        groups.append(Text(f"probe {len(view.probe.tokens)} tokens ({view.probe.label})", style="bold"))
        if status.probe_error is not None:
            groups.append(Text(f"probe failed: {status.probe_error}", style="red"))
    return groups


def flow(groups: list[Text], width: int) -> Text:
    """The groups as lines no wider than ``width`` (a group wider than that gets a line of its own)."""
    lines: list[Text] = []
    line = Text()
    for group in groups:
        if line.cell_len and line.cell_len + len(_GAP) + group.cell_len > width:
            lines.append(line)
            line = Text()
        if line.cell_len:
            line.append(_GAP)
        line.append_text(group)
    lines.append(line)
    return Text("\n").join(lines)


class Meters(Widget):
    """The header meters; :meth:`show` gives it what to draw."""

    DEFAULT_CSS = """
    Meters {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._groups: list[Text] = [Text("waiting for the first snapshot…")]

    def show(self, snapshot: Snapshot, rates: Rates, status: Status) -> None:
        self._groups = header_groups(snapshot, rates, status)
        self.refresh(layout=True)

    @property
    def text(self) -> str:
        """What the header reads, as plain text (for tests and the tmux check)."""
        return " ".join(group.plain for group in self._groups)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(flow(self._groups, width).split("\n"))

    def render(self) -> Text:
        return flow(self._groups, self.content_size.width)
