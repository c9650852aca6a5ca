"""SVG snapshots of the dashboard's main screens at the two sizes the issue names (80x24, 200x50).

Each screen is built from the seeded fake feed, ticked by hand, with the app's clock the feed's, so the
SVG depends only on the code and the pinned Textual (spec §4.2). Refresh with
``pytest tests/tui/test_snapshots.py --snapshot-update`` after a deliberate change, and look at them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.pilot import Pilot

from tests.tui.fake_feed import FakeFeed, gone
from tui.app import TopApp
from tui.probe import Probe

SnapCompare = Callable[..., bool]


def busy_feed(*, workers: int = 4, temperature: float = 0.0) -> FakeFeed:
    """A router an hour up, with a stale worker, an unhealthy one and a worker that lost a gap."""
    feed = FakeFeed(workers=workers, temperature=temperature)
    feed.mark(2, 1, state="stale")
    feed.mark(3, 0, gaps=2, lost=1)
    feed.mark(4, 1, state="unhealthy")
    return feed


async def ticks(app: TopApp, feed: FakeFeed, count: int = 12) -> None:
    """``count`` refreshes a quarter second apart: enough history for the sparklines and the rates."""
    for _ in range(count):
        feed.step()
        await app.tick()


def test_dashboard_80x24(snap_compare: SnapCompare) -> None:
    feed = busy_feed()
    app = TopApp(feed, clock=feed.clock, manual=True)

    async def run_before(pilot: Pilot[Any]) -> None:
        await ticks(app, feed)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_dashboard_200x50_events_pane_softmax_sorted_by_cost(snap_compare: SnapCompare) -> None:
    feed = busy_feed(workers=12, temperature=0.5)
    app = TopApp(feed, clock=feed.clock, manual=True)

    async def run_before(pilot: Pilot[Any]) -> None:
        await ticks(app, feed)
        app.view.sort_key = "overlap"
        await pilot.press("s", "e")

    assert snap_compare(app, terminal_size=(200, 50), run_before=run_before)


def test_probe_pinned_sorted_by_overlap_200x50(snap_compare: SnapCompare) -> None:
    feed = busy_feed(workers=6)
    app = TopApp(feed, clock=feed.clock, manual=True)

    async def run_before(pilot: Pilot[Any]) -> None:
        await ticks(app, feed, 4)
        app.pin_probe(Probe(tuple(range(512)), "file prompt.json"))
        await ticks(app, feed, 1)
        app.view.sort_key = "reqs"
        await pilot.press("s")

    assert snap_compare(app, terminal_size=(200, 50), run_before=run_before)


def test_router_not_there_80x24(snap_compare: SnapCompare) -> None:
    feed = busy_feed()
    app = TopApp(feed, clock=feed.clock, manual=True)

    async def run_before(pilot: Pilot[Any]) -> None:
        await ticks(app, feed, 2)
        feed.gone = gone()
        await app.tick()
        feed.clock.now += 37
        await app.tick()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
