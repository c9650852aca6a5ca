"""``Rates``: differences of totals over differences of ``taken_at``, and what breaks a rate."""

from __future__ import annotations

from dataclasses import replace

from tests.tui.fake_feed import FakeFeed
from tui.rates import Rates


def test_rates_need_two_snapshots_and_divide_by_the_interval() -> None:
    feed = FakeFeed()
    rates = Rates()
    first = feed.poll()
    rates.update(first)
    assert rates.current["events"] is None
    assert rates.cached == {}
    feed.step(0.5)
    second = feed.poll()
    rates.update(second)
    assert rates.current["queries"] == (second.queries_total - first.queries_total) / 0.5
    assert rates.cached[(1, 0)] == (second.workers[0].cached_blocks - first.workers[0].cached_blocks) / 0.5
    assert list(rates.history["decisions"]) == [rates.current["decisions"]]


def test_a_rate_spans_the_window_not_one_refresh() -> None:
    feed = FakeFeed()
    rates = Rates(window=2.0)
    seen = []
    for _ in range(12):
        seen.append(feed.poll())
        rates.update(seen[-1])
        feed.step(0.25)
    now, then = seen[-1], seen[-9]  # 2 s before the last
    assert rates.current["decisions"] == (now.decisions_total - then.decisions_total) / 2.0
    assert rates.cached[(1, 0)] == (now.workers[0].cached_blocks - then.workers[0].cached_blocks) / 2.0


def test_a_total_that_goes_down_or_a_restart_gives_no_rate() -> None:
    feed = FakeFeed()
    rates = Rates()
    first = feed.poll()
    rates.update(first)
    feed.step()
    rates.update(replace(feed.poll(), events_total=0))
    assert rates.current["events"] is None
    assert rates.current["queries"] is not None
    feed.step()
    rates.update(replace(feed.poll(), started_at=feed.now))
    assert rates.current == {"events": None, "queries": None, "decisions": None}


def test_reset_forgets_the_history_and_the_last_snapshot() -> None:
    feed = FakeFeed()
    rates = Rates(history=3)
    for _ in range(5):
        rates.update(feed.poll())
        feed.step()
    assert len(rates.history["events"]) == 3
    rates.reset()
    assert not rates.history["events"]
    rates.update(feed.poll())
    assert rates.current["events"] is None
