"""``kvrouter top`` against a real ``kvrouter up``: the embedded demo's two mock engines and built-in client,
found through the discovery file, read through shared memory; then the service is killed under it.

The dashboard is the one ``kvrouter top`` runs (``TopApp`` over ``LocalFeed``), driven tick by tick
through Pilot; only the router is live. Waits are bounded polls for a condition, never a timed assert.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static

from tests.service.test_up import START_TIMEOUT_S, URL_LINE, Up, descendants, kill_and_sweep
from tui.app import TopApp
from tui.feed import LocalFeed
from tui.screens import NotThereScreen

pytestmark = pytest.mark.timeout(400)

SIZE = (200, 50)
BANNER = re.compile(r"Ctrl-C stops everything")
"""The demo's banner: its mock engines are up and registered."""


async def until(app: TopApp, done: Callable[[], bool], timeout: float = 60.0) -> None:
    """Tick the app (a poll of the live router each time) until ``done()``; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        await app.tick()
        if done():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout}s; screen {type(app.screen).__name__}")
        await asyncio.sleep(0.25)


def cached(app: TopApp) -> list[int]:
    return [row.cached_blocks for row in app.snapshot.workers] if app.snapshot else []


def newest_decision(app: TopApp) -> int:
    return app.snapshot.decisions[-1].seq if app.snapshot and app.snapshot.decisions else 0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Path]]:
    """One ``kvrouter up`` (two mock engines, the demo client) for the module, with its discovery file in
    a runtime directory of its own; the last test kills it, and whatever it left is cleaned here."""
    folder = tmp_path_factory.mktemp("live")
    runtime = folder / "run"
    runtime.mkdir(mode=0o700)
    up = Up(
        "--mock-workers", "2", "--shards", "1", "--client-rate", "8",
        stderr=folder / "up.err", env_extra={"XDG_RUNTIME_DIR": str(runtime)},
    )  # fmt: skip
    tree: list[tuple[int, str]] = []
    try:
        up.expect(URL_LINE, START_TIMEOUT_S)
        up.expect(BANNER, START_TIMEOUT_S)
        tree = descendants(up.proc.pid)
        yield up, runtime / "kvrouter"
    finally:
        up.close()
        kill_and_sweep(tree)


async def test_top_over_a_live_router_shows_its_workers_and_its_decisions_moving(live: tuple[Up, Path]) -> None:
    up, discovery = live
    app = TopApp(LocalFeed(directory=discovery), manual=True)
    async with app.run_test(size=SIZE) as pilot:
        await until(app, lambda: app.table.row_count == 2 and all(cached(app)) and newest_decision(app) > 0)
        assert app.feed.source == f"shm:kvrouter-{up.proc.pid}-stats"
        assert app.snapshot is not None
        assert {row.key for row in app.snapshot.workers} == {(1, 0), (2, 0)}
        assert app.query_one(DataTable).row_count == 2
        first = newest_decision(app)
        await until(app, lambda: newest_decision(app) > first)  # the client keeps routing: the log moves
        await pilot.pause()
        assert app.view.pane == "decisions"  # the default pane
        assert app.decision_log.display
        assert app.decision_log.row_count == len(app.snapshot.decisions) > 1
        assert str(app.decision_log.get_row_at(0)[0]).strip() == str(newest_decision(app))  # newest on top


async def test_top_says_the_router_is_gone_when_it_is_killed_under_it(
    live: tuple[Up, Path], shm_entries: Callable[[int], list[str]]
) -> None:
    up, discovery = live
    app = TopApp(LocalFeed(directory=discovery), manual=True)
    async with app.run_test(size=SIZE) as pilot:
        await until(app, lambda: app.table.row_count == 2)
        tree = descendants(up.proc.pid)
        up.proc.send_signal(signal.SIGKILL)  # no shutdown: its discovery file and segments stay behind
        up.proc.wait()
        await until(app, lambda: isinstance(app.screen, NotThereScreen), timeout=30)
        await pilot.pause()
        assert app.router_gone
        text = str(app.screen.query_one("#not-there-text", Static).content)
        assert "router not there" in text
        # the dead pid, or its engine's segments already swept by another engine's start
        assert f"pid {up.proc.pid}" in text or f"kvrouter-{up.proc.pid}-" in text
        await app.tick()  # and it keeps trying: nothing else runs here, so it stays not there
        assert isinstance(app.screen, NotThereScreen)
    kill_and_sweep(tree)
    assert shm_entries(up.proc.pid) == []
