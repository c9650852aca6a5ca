"""``TopApp``: the live dashboard over one feed (spec §4.1).

The app polls its feed at the refresh interval, off the UI thread (``asyncio.to_thread``: a poll reads
shared memory or waits on HTTP, and either may block), keeps the last snapshot and the rates derived from
the ones before, and renders them through the widgets. Every key only changes the :class:`~tui.view.View`
and re-renders from the last snapshot, so keys act at once, even while paused.

A poll that raises pushes the not-there screen: :class:`~tui.model.RouterGone` for a router that is gone,
anything else for a feed that broke, shown by name on the same screen rather than as a traceback, since
the operator's question ("is the router up?") is the same. Polling goes on at the same interval and the
first snapshot that arrives pops the screen.

Time comes from the injected ``clock`` (``time.time`` by default, the real feeds' clock): it only says
how old the last snapshot is (the stale flag) and how long the router has been gone; every age in the
table and the logs is taken against the snapshot's own ``taken_at``. Tests pass ``manual=True`` and drive
:meth:`TopApp.tick` themselves, so no timer races the assertions (spec §4.2).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import ClassVar, Final

from textual import events
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Input

from tui.model import Feed, ProbeRow, RouterGone, Snapshot
from tui.probe import Probe
from tui.rates import Rates
from tui.screens import DetailScreen, HelpScreen, NotThereScreen, ProbeScreen
from tui.view import INTERVALS, SORT_KEYS, Pane, View
from tui.widgets import DecisionLog, EventLog, Meters, RateStrip, WorkerTable
from tui.widgets.meters import Status
from tui.widgets.worker_table import build_lines, choose_columns, has_roles, held_tiers

__all__ = ["TopApp"]

log = logging.getLogger(__name__)

STALE_INTERVALS: Final = 4
"""The data is flagged stale once it is this many refresh intervals old (and at least a second)."""


class TopApp(App[None]):
    """The dashboard. ``feed`` is polled every ``interval`` seconds unless ``manual``."""

    CSS_PATH = "top.tcss"
    TITLE = "kvrouter top"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p,space", "pause", "pause"),
        Binding("s", "sort", "sort"),
        Binding("S", "reverse", "reverse", show=False),
        Binding("slash", "filter", "filter"),
        Binding("e", "pane('events')", "events"),
        Binding("d", "pane('decisions')", "decisions"),
        Binding("i", "probe", "probe"),
        Binding("t", "costs", "costs", show=False),
        Binding("r", "reset_rates", "reset rates", show=False),
        Binding("plus,equals_sign", "faster", "faster", show=False),
        Binding("minus", "slower", "slower", show=False),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(
        self,
        feed: Feed,
        *,
        interval: float = 0.25,
        clock: Callable[[], float] = time.time,
        manual: bool = False,
    ) -> None:
        """
        Args:
            feed: Where snapshots come from; the app closes it on exit.
            interval: Seconds between polls (``+``/``-`` change it).
            clock: Seconds, on the feed's clock; only for the stale flag and the not-there timer.
            manual: Poll only when :meth:`tick` is called (tests).
        """
        super().__init__()
        self.feed = feed
        self.clock = clock
        self.manual = manual
        self.view = View(interval=interval)
        """The operator's choices."""
        self.rates = Rates()
        self.snapshot: Snapshot | None = None
        """The last snapshot a poll returned."""
        self.probe_rows: tuple[ProbeRow, ...] = ()
        """The pinned probe's answer at the last poll."""
        self.probe_error: str | None = None
        self.gone_since: float | None = None
        """When polls started failing; None while the router answers."""
        self.not_there: NotThereScreen | None = None
        """The not-there screen while it is pushed (one per outage)."""
        self._poll_lock = asyncio.Lock()
        self._pane_shows: tuple[Snapshot, Pane | None] | None = None
        self._timer: Timer | None = None

    # -- layout and lifecycle --------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Meters(id="meters")
        yield RateStrip(id="rates")
        yield WorkerTable(id="workers")
        yield DecisionLog(id="decisions")
        yield EventLog(id="events")
        yield Input(placeholder="filter workers: worker:dp, state or model", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        # The main screen's widgets, held so they can be updated while another screen is on top
        # (``App.query_one`` looks only at the active screen).
        self.meters = self.query_one(Meters)
        self.rate_strip = self.query_one(RateStrip)
        self.table = self.query_one(WorkerTable)
        self.decision_log = self.query_one(DecisionLog)
        self.event_log = self.query_one(EventLog)
        self.filter_bar = self.query_one("#filter", Input)
        self._show_pane()
        if not self.manual:
            self._start_timer()
            self.run_worker(self.tick(), group="poll")

    def on_unmount(self) -> None:
        self.feed.close()

    def on_worker_table_resized(self) -> None:
        self.render_snapshot()

    def _start_timer(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(self.view.interval, self.tick, name="poll")

    # -- polling -----------------------------------------------------------------------------------

    @property
    def router_gone(self) -> bool:
        return self.gone_since is not None

    async def tick(self) -> None:
        """One refresh: poll the feed (and the probe) off the UI thread, then show the result. Paused, the
        dashboard keeps its last snapshot; a router that is not there is still retried, so the way back
        never waits for a key."""
        if self.view.paused and not self.router_gone:
            return
        async with self._poll_lock:
            probe = self.view.probe
            try:
                snapshot = await asyncio.to_thread(self.feed.poll)
            except RouterGone as exc:
                self._report_gone(f"{exc}" or "the router is not there")
                return
            except Exception as exc:  # a broken feed is shown, never a traceback
                log.warning("poll failed feed=%s error=%r", self.feed.source, exc)
                self._report_gone(f"{type(exc).__name__}: {exc}")
                return
            if probe is not None:
                await self._poll_probe(probe)
            self._apply(snapshot)

    async def _poll_probe(self, probe: Probe) -> None:
        try:
            self.probe_rows = await asyncio.to_thread(self.feed.probe, probe.tokens)
            self.probe_error = None
        except RouterGone:
            self.probe_rows = ()
        except Exception as exc:  # the dashboard stays; the header says what the probe got
            self.probe_rows = ()
            self.probe_error = f"{type(exc).__name__}: {exc}"

    def _report_gone(self, error: str) -> None:
        now = self.clock()
        if self.gone_since is None:
            self.gone_since = now
            self.not_there = NotThereScreen(self.feed.source)
            self.push_screen(self.not_there)
        assert self.not_there is not None
        self.not_there.report(error, since=self.gone_since, now=now, interval=self.view.interval)

    def _apply(self, snapshot: Snapshot) -> None:
        if self.not_there is not None:
            if self.not_there in self.screen_stack:  # and any screen opened over it
                while self.screen is not self.not_there:
                    self.pop_screen()
                self.pop_screen()
            self.not_there = None
        self.gone_since = None
        self.snapshot = snapshot
        self.rates.update(snapshot)
        self.render_snapshot()

    # -- rendering ---------------------------------------------------------------------------------

    def render_snapshot(self) -> None:
        """Show the last snapshot as the view says (after a poll, and after every key)."""
        snapshot = self.snapshot
        if snapshot is None:
            return
        with_p = snapshot.weights.get("T", 0.0) > 0
        lines = build_lines(snapshot, self.rates, self.view, self.probe_rows)
        worker_chars = max((line.cells["worker"].cell_len for line in lines), default=0)
        columns = choose_columns(
            self.table.size.width or self.size.width,
            with_p=with_p,
            worker_chars=worker_chars,
            tiers=held_tiers(snapshot.workers),
            roles=has_roles(snapshot.workers),
        )
        status = Status(
            now=self.clock(),
            stale_after=max(1.0, STALE_INTERVALS * self.view.interval),
            view=self.view,
            probe_error=self.probe_error,
            sort_shown=any(column.key == self.view.sort_key for column in columns),
        )
        self.meters.show(snapshot, self.rates, status)
        self.rate_strip.show(self.rates)
        self.table.show(lines, columns, self.view)
        if self._pane_shows != (snapshot, self.view.pane):  # the logs change only with the snapshot
            self._pane_shows = (snapshot, self.view.pane)
            if self.view.pane == "decisions":
                self.decision_log.show(snapshot.decisions, snapshot.taken_at)
            elif self.view.pane == "events":
                self.event_log.show(snapshot.events, snapshot.taken_at)
        for screen in self.screen_stack:
            if isinstance(screen, DetailScreen) and screen.is_attached:
                screen.show(snapshot, self.rates)

    def _show_pane(self) -> None:
        self.decision_log.display = self.view.pane == "decisions"
        self.event_log.display = self.view.pane == "events"

    # -- keys --------------------------------------------------------------------------------------

    def action_pause(self) -> None:
        self.view.paused = not self.view.paused
        self.render_snapshot()

    def action_sort(self) -> None:
        self.view.sort_key = SORT_KEYS[(SORT_KEYS.index(self.view.sort_key) + 1) % len(SORT_KEYS)]
        self.render_snapshot()

    def action_reverse(self) -> None:
        self.view.sort_reverse = not self.view.sort_reverse
        self.render_snapshot()

    def action_filter(self) -> None:
        self.filter_bar.display = True
        self.filter_bar.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.view.filter = event.value.strip()
            self.render_snapshot()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self._close_filter()

    def on_key(self, event: events.Key) -> None:
        if event.key == "escape" and self.filter_bar.has_focus:
            self.filter_bar.value = ""
            self.view.filter = ""
            self._close_filter()
            self.render_snapshot()

    def _close_filter(self) -> None:
        self.filter_bar.display = bool(self.view.filter)
        self.table.focus()

    def action_pane(self, pane: Pane) -> None:
        self.view.pane = None if self.view.pane == pane else pane
        self._show_pane()
        self.render_snapshot()

    def action_costs(self) -> None:
        self.view.normalised = not self.view.normalised
        self.render_snapshot()

    def action_reset_rates(self) -> None:
        self.rates.reset()
        if self.snapshot is not None:
            self.rates.update(self.snapshot)
        self.render_snapshot()

    def action_faster(self) -> None:
        self._set_interval(max((i for i in INTERVALS if i < self.view.interval), default=INTERVALS[0]))

    def action_slower(self) -> None:
        self._set_interval(min((i for i in INTERVALS if i > self.view.interval), default=INTERVALS[-1]))

    def _set_interval(self, interval: float) -> None:
        self.view.interval = interval
        if not self.manual:
            self._start_timer()
        self.render_snapshot()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if self.snapshot is None or event.data_table.id != "workers" or event.row_key.value is None:
            return
        worker, dp = (int(part) for part in event.row_key.value.split(":"))
        screen = DetailScreen((worker, dp))
        self.push_screen(screen)
        screen.call_after_refresh(self.render_snapshot)

    def action_probe(self) -> None:
        self.push_screen(ProbeScreen(), self.pin_probe)

    def pin_probe(self, probe: Probe | None) -> None:
        """Pin ``probe`` (None unpins); its overlap and cost show from the next poll on."""
        self.view.probe = probe
        self.probe_rows = ()
        self.probe_error = None
        self.render_snapshot()

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Pause / resume", "Stop or restart polling the router", self.action_pause)
        yield SystemCommand("Cycle sort", "Sort the workers by the next key", self.action_sort)
        yield SystemCommand("Reverse sort", "Flip the sort direction", self.action_reverse)
        yield SystemCommand("Pin a probe prompt", "Watch one prompt's overlap and cost per worker", self.action_probe)
        yield SystemCommand("Raw / normalised costs", "Costs as routed, or minus the lowest", self.action_costs)
        yield SystemCommand("Reset rates", "Forget the rate history", self.action_reset_rates)
