"""Pilot tests of ``TopApp`` over the fake feed: each key's effect on the app's state and the table.

The app runs with ``manual=True`` and every refresh is an explicit ``await app.tick()`` after the fake
has been stepped, so nothing here waits on a timer; assertions read state (``app.view``, the table's
rows and cells, the screen stack), not pixels (spec §4.2).
"""

from __future__ import annotations

from dataclasses import replace

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import Input, Static
from textual.widgets.data_table import ColumnKey

from tests.tui.fake_feed import FakeFeed, gone
from tui import cells
from tui.app import TopApp
from tui.model import Shadow
from tui.screens import DetailScreen, HelpScreen, NotThereScreen, ProbeScreen
from tui.view import SORT_KEYS
from tui.widgets.worker_table import MARK, row_key

SIZE = (120, 30)
WIDE = (160, 40)
"""Wide enough for the full column set (cost breakdown, prefill)."""


def make_app(feed: FakeFeed) -> TopApp:
    return TopApp(feed, clock=feed.clock, manual=True)


def cell(app: TopApp, row: str, column: str) -> str:
    value = app.table.get_cell(row, column)
    assert isinstance(value, Text)
    return value.plain


def order(app: TopApp) -> list[str]:
    """The row keys top to bottom, as shown."""
    return [
        app.table.coordinate_to_cell_key(Coordinate(index, 0)).row_key.value or ""
        for index in range(app.table.row_count)
    ]


async def test_a_tick_fills_one_row_per_worker_and_rank(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        assert app.table.row_count == 0
        await app.tick()
        assert app.table.row_count == len(fake_feed.rows) == 8
        row = fake_feed.rows[(2, 1)]
        assert cell(app, "2:1", "cached") == cells.count(row.cached_blocks)
        assert cell(app, "2:1", "reqs") == str(row.requests)
        assert app.table.get_cell("2:1", "cached").justify == "right"
        chosen = fake_feed.decisions[-1]
        assert cell(app, row_key((chosen.worker_id, chosen.dp_rank)), "worker").startswith(MARK)
        assert "queries" in app.meters.text


async def test_cells_follow_the_feed_and_rates_come_from_two_snapshots(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        assert app.rates.current["events"] is None
        assert cell(app, "1:0", "delta") == cells.DASH
        before = fake_feed.poll()
        fake_feed.step(0.5)
        await app.tick()
        after = fake_feed.rows[(1, 0)]
        assert cell(app, "1:0", "cached") == cells.count(after.cached_blocks)
        assert app.rates.current["events"] == (fake_feed.totals["events"] - before.events_total) / 0.5
        delta = (after.cached_blocks - before.workers[0].cached_blocks) / 0.5
        assert cell(app, "1:0", "delta") == cells.signed_rate(delta)


async def test_s_cycles_the_sort_key_and_shift_s_reverses_it(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        assert order(app) == [row_key(key) for key in sorted(fake_feed.rows)]
        await pilot.press("s")
        assert app.view.sort_key == "cached"
        by_cached = sorted(fake_feed.rows.values(), key=lambda row: -row.cached_blocks)
        assert order(app) == [row_key(row.key) for row in by_cached]
        assert app.table.columns[ColumnKey("cached")].label.plain == "cached▼"
        await pilot.press("S")
        assert app.view.sort_reverse
        assert order(app) == [row_key(row.key) for row in reversed(by_cached)]
        app.view.sort_key = SORT_KEYS[-1]
        await pilot.press("s")
        assert app.view.sort_key == SORT_KEYS[0]


async def test_rows_are_updated_in_place_and_the_cursor_stays_on_its_worker(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        await pilot.press("down", "down", "down")
        assert app.table.cursor_key == "2:1"
        await pilot.press("s")
        fake_feed.step()
        await app.tick()
        assert app.table.cursor_key == "2:1"


async def test_pause_stops_polling_until_resumed(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        shown = cell(app, "1:0", "cached")
        await pilot.press("p")
        assert app.view.paused
        assert "PAUSED" in app.meters.text
        polls = fake_feed.polls
        fake_feed.step(decisions=0)
        fake_feed.rows[(1, 0)] = replace(fake_feed.rows[(1, 0)], cached_blocks=99_999)
        await app.tick()
        assert fake_feed.polls == polls
        assert cell(app, "1:0", "cached") == shown
        await pilot.press("space")
        assert not app.view.paused
        await app.tick()
        assert cell(app, "1:0", "cached") == "100.0k"


async def test_the_data_is_flagged_stale_by_the_injected_clock(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        assert "stale" not in app.meters.text
        fake_feed.clock.now += 2.5
        app.render_snapshot()
        assert "stale 2.5s" in app.meters.text


async def test_the_header_shows_replicas_and_sync_lag_only_with_the_bridge(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        assert "replicas" not in app.meters.text
        fake_feed.replicas = (2, 3.4)
        fake_feed.step()
        await app.tick()
        assert "replicas 2, sync lag 3 ms" in app.meters.text


async def test_the_header_shows_the_index_use_against_its_cap_and_the_evictions(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        assert " blocks" not in app.meters.text
        fake_feed.index = (394, 400, 0)
        fake_feed.step()
        await app.tick()
        assert "index 394/400 blocks" in app.meters.text
        assert "evicted" not in app.meters.text
        fake_feed.index = (1_200_000, 8_388_608, 806)
        fake_feed.step()
        await app.tick()
        assert "index 1.2M/8.4M blocks, 806 evicted" in app.meters.text
        fake_feed.index = (52, 0, 0)  # no cap
        fake_feed.step()
        await app.tick()
        assert "index 52 blocks" in app.meters.text


async def test_the_header_compares_each_shadow_policy_with_the_live_one(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        assert "shadow" not in app.meters.text
        fake_feed.shadows = {
            "greedy_overlap": Shadow(10, 5, 80, 100, 110, 100),
            "round_robin": Shadow(0, 0, 0, 0, 0, 0),
        }
        fake_feed.step()
        await app.tick()
        assert "shadow greedy_overlap agree 50% ovl 80% of live cost +10%" in app.meters.text
        assert "shadow round_robin -" in app.meters.text


async def test_the_detail_screen_shows_the_index_accuracy(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    key = next(iter(fake_feed.rows))
    problem = "worker 0:0 sends KV blocks of a size other than its registered block_size 16"
    fake_feed.rows[key] = replace(
        fake_feed.rows[key], accuracy=0.42, drift=True, state="misconfig", problems=(problem,)
    )
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        screen = DetailScreen(key)
        await app.push_screen(screen)
        await pilot.pause()
        screen.show(fake_feed.poll(), app.rates)
        text = str(screen.query_one("#detail-text", Static).render())
        assert "42% of recent reuse reports as predicted (DRIFT)" in text
        assert problem in text
        assert "misconfig" in text


async def test_slash_filters_workers_and_escape_clears_the_filter(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        await pilot.press("slash")
        assert app.filter_bar.has_focus
        await pilot.press("3", ":")
        assert app.view.filter == "3:"
        assert sorted(order(app)) == ["3:0", "3:1"]
        await pilot.press("enter")
        assert app.filter_bar.display
        assert app.table.has_focus
        fake_feed.step()
        await app.tick()
        assert app.table.row_count == 2
        await pilot.press("slash", "escape")
        assert app.view.filter == ""
        assert app.table.row_count == 8
        assert not app.filter_bar.display


async def test_workers_that_come_and_go_add_and_remove_rows(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        del fake_feed.rows[(4, 1)]
        fake_feed.step()
        await app.tick()
        assert app.table.row_count == 7
        assert "4:1" not in app.table.rows


async def test_e_and_d_switch_the_bottom_pane_and_hide_it(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        assert app.view.pane == "decisions"
        assert app.decision_log.row_count == len(fake_feed.decisions)
        newest = fake_feed.decisions[-1]
        first = app.decision_log.get_row_at(0)
        assert first[0].plain == str(newest.seq)
        assert "*" in first[-1].plain
        await pilot.press("e")
        assert app.view.pane != "decisions"
        assert app.view.pane == "events"
        assert app.event_log.display
        assert not app.decision_log.display
        assert app.event_log.row_count == len(fake_feed.events)
        await pilot.press("e")
        assert app.view.pane is None
        assert not app.event_log.display
        assert not app.decision_log.display
        await pilot.press("d")
        assert app.view.pane == "decisions"


async def test_t_shows_costs_minus_the_lowest(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=(200, 50)) as pilot:
        await app.tick()
        await pilot.press("t")
        assert app.view.normalised
        chosen = fake_feed.decisions[-1]
        assert cell(app, row_key((chosen.worker_id, chosen.dp_rank)), "cost") == "0.0"
        runner_up = sorted(c.total for c in chosen.candidates)[1]
        shown = sorted(cell(app, key, "cost") for key in order(app) if cell(app, key, "cost") != "0.0")
        assert cells.cost(runner_up - chosen.cost) in shown


async def test_p_select_column_only_when_the_temperature_is_above_zero() -> None:
    for temperature, expected in ((0.0, False), (0.5, True)):
        feed = FakeFeed(temperature=temperature)
        feed.step()
        app = make_app(feed)
        async with app.run_test(size=(200, 50)):
            await app.tick()
            assert ("p" in app.table.columns) is expected


async def test_the_narrow_column_set_fits_80_columns(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.tick()
        assert "prefill_cost" not in app.table.columns
        assert app.table.virtual_size.width <= 80
        await pilot.resize_terminal(200, 50)
        for _ in range(100):  # the app applies a resize on a timer of its own: wait for the table's
            if "prefill_cost" in app.table.columns:
                break
            await pilot.pause()
        assert "prefill_cost" in app.table.columns
        assert app.table.row_count == 8


async def test_a_column_per_slower_tier_appears_once_a_worker_holds_blocks_there(fake_feed: FakeFeed) -> None:
    """No tier column while every block is on the device; host and disk columns (not shared, which no one
    holds) with each worker's count once two workers offload; ``cached`` stays the device count."""
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE):
        await app.tick()
        assert not {"host", "disk", "shared", "other"} & set(app.table.columns)
        fake_feed.offload(1, 0, host=1_500)
        fake_feed.offload(3, 1, host=20, disk=7)
        fake_feed.step()
        await app.tick()
        shown = [key.value for key in app.table.columns]
        assert shown[shown.index("delta") + 1 : shown.index("delta") + 3] == ["host", "disk"]
        assert not {"shared", "other"} & set(shown)
        assert (cell(app, "1:0", "host"), cell(app, "1:0", "disk")) == ("1.5k", "0")
        assert (cell(app, "3:1", "host"), cell(app, "3:1", "disk")) == ("20", "7")
        assert (cell(app, "2:0", "host"), cell(app, "2:0", "disk")) == ("0", "0")
        assert cell(app, "3:1", "cached") == cells.count(fake_feed.rows[(3, 1)].cached_blocks)
        assert app.table.get_cell("3:1", "host").justify == "right"


async def test_a_role_column_follows_state_once_a_worker_is_not_both(fake_feed: FakeFeed) -> None:
    """An aggregated fleet's table is as before roles; a disaggregated one shows each worker's role after its
    state, in the narrow set too when it fits (at 88 columns), and not at 80 (the detail screen says it)."""
    app = make_app(fake_feed)
    async with app.run_test(size=WIDE):
        await app.tick()
        assert "role" not in app.table.columns
    fake_feed.rows[(1, 0)] = replace(fake_feed.rows[(1, 0)], role="prefill")
    fake_feed.rows[(2, 0)] = replace(fake_feed.rows[(2, 0)], role="decode")
    fake_feed.step()
    for size, shown in ((WIDE, True), ((88, 24), True), ((80, 24), False)):
        app = make_app(fake_feed)
        async with app.run_test(size=size) as pilot:
            await app.tick()
            columns = [key.value for key in app.table.columns]
            assert ("role" in columns) is shown, (size, columns)
            assert app.table.virtual_size.width <= size[0]
            if shown:
                assert columns[columns.index("state") + 1] == "role"
                roles = {row: cell(app, row, "role") for row in ("1:0", "2:0", "3:0")}
                assert roles == {"1:0": "prefill", "2:0": "decode", "3:0": "both"}
            else:
                app.table.move_cursor(row=app.table.get_row_index("1:0"))
                await pilot.press("enter")
                await pilot.pause()
                assert isinstance(app.screen, DetailScreen)
                assert "    role  prefill\n" in str(app.screen.query_one("#detail-text", Static).content)


async def test_the_slower_tiers_fold_into_one_other_column_or_none_when_narrow(fake_feed: FakeFeed) -> None:
    """At 88 columns the narrow set has room for one ``other`` column (host + disk), not one per tier; at 80,
    for none: the detail screen still lists every tier."""
    fake_feed.offload(3, 1, host=20, disk=7)
    fake_feed.step()
    app = make_app(fake_feed)
    async with app.run_test(size=(88, 24)):
        await app.tick()
        assert {"other"} == {"host", "disk", "shared", "other"} & set(app.table.columns)
        assert (cell(app, "3:1", "other"), cell(app, "1:0", "other")) == ("27", "0")
        assert app.table.virtual_size.width <= 88
    app = make_app(fake_feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.tick()
        assert not {"host", "disk", "shared", "other"} & set(app.table.columns)
        assert app.table.virtual_size.width <= 80
        app.table.move_cursor(row=app.table.get_row_index("3:1"))
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        text = str(app.screen.query_one("#detail-text", Static).content)
        row = fake_feed.rows[(3, 1)]
        assert f"cached blocks  {row.cached_blocks} device\n" in text
        for tier, count in (("host", 20), ("disk", 7), ("shared", 0)):
            assert f"  {count} {tier}\n" in text


async def test_plus_and_minus_step_the_refresh_interval(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("plus")
        assert app.view.interval == 0.125
        await pilot.press("plus")
        assert app.view.interval == 0.125
        await pilot.press("minus", "minus", "minus")
        assert app.view.interval == 1.0


async def test_r_resets_the_rates(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        fake_feed.step()
        await app.tick()
        assert app.rates.current["events"] is not None
        await pilot.press("r")
        assert app.rates.current["events"] is None
        assert not app.rates.history["events"]


async def test_router_gone_shows_the_not_there_screen_until_a_poll_succeeds(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        fake_feed.gone = gone()
        await app.tick()
        await pilot.pause()
        assert isinstance(app.screen, NotThereScreen)
        assert app.router_gone
        fake_feed.clock.now += 3
        await app.tick()
        await pilot.pause()
        text = str(app.screen.query_one("#not-there-text", Static).content)
        assert "router not there" in text
        assert "retrying every 0.25s" in text
        assert "segment missing" in text
        assert "3.0s ago, 2 attempts" in text
        fake_feed.gone = None
        fake_feed.step()
        await app.tick()
        await pilot.pause()
        assert not isinstance(app.screen, NotThereScreen)
        assert not app.router_gone
        assert app.table.row_count == 8


async def test_a_router_gone_while_paused_is_still_retried(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        await pilot.press("p")
        assert app.view.paused
        fake_feed.gone = gone()
        app.view.paused = False  # the outage is found by a poll; pause again on its screen
        await app.tick()
        await pilot.pause()
        assert isinstance(app.screen, NotThereScreen)
        await pilot.press("p")
        assert app.view.paused
        fake_feed.gone = None
        fake_feed.step()
        await app.tick()
        await pilot.pause()
        assert not app.router_gone
        assert not isinstance(app.screen, NotThereScreen)


async def test_an_unexpected_feed_error_is_shown_not_raised(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        fake_feed.gone = ValueError("stats segment has version 9")
        await app.tick()
        await pilot.pause()
        assert isinstance(app.screen, NotThereScreen)
        assert app.screen.error == "ValueError: stats segment has version 9"
        fake_feed.gone = None
        await app.tick()
        await pilot.pause()
        assert not app.router_gone


async def test_a_pinned_probe_fills_overlap_and_cost_each_refresh(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    tokens = " ".join(str(token) for token in range(320))
    async with app.run_test(size=WIDE) as pilot:
        await app.tick()
        await pilot.press("i")
        assert isinstance(app.screen, ProbeScreen)
        app.screen.query_one(Input).value = tokens
        await pilot.press("enter")
        assert app.view.probe is not None
        assert app.view.probe.label == "pasted"
        await app.tick()
        assert fake_feed.probes == [tuple(range(320))]
        probed = {(row.worker_id, row.dp_rank): row for row in fake_feed.probe(range(320))}
        assert cell(app, "1:0", "overlap") == str(probed[(1, 0)].overlap_blocks)
        assert cell(app, "1:0", "prefill_cost") == cells.DASH
        assert "probe 320 tokens (pasted)" in app.meters.text
        await pilot.press("i", "enter")
        assert app.view.probe is None


async def test_a_probe_that_is_not_token_ids_is_refused_on_its_screen(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        await pilot.press("i")
        app.screen.query_one(Input).value = "12 apples"
        await pilot.press("enter")
        assert isinstance(app.screen, ProbeScreen)
        assert "'apples'" in str(app.screen.query_one("#probe-error", Static).content)
        await pilot.press("escape")
        assert app.view.probe is None
        assert not isinstance(app.screen, ProbeScreen)


async def test_enter_opens_the_worker_detail_and_it_follows_refreshes(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await app.tick()
        await pilot.press("down", "enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        assert app.screen.key == (1, 1)
        fake_feed.step()
        await app.tick()
        text = str(app.screen.query_one("#detail-text", Static).content)
        assert f"cached blocks  {fake_feed.rows[(1, 1)].cached_blocks}" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, DetailScreen)


async def test_question_mark_opens_help_and_q_quits_and_closes_the_feed(fake_feed: FakeFeed) -> None:
    app = make_app(fake_feed)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert fake_feed.closed
