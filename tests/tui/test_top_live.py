"""``kvrouter top`` against a real ``kvrouter up``: the embedded demo's two mock engines and built-in client,
found through the discovery file, read through shared memory; then the service is killed under it.

The dashboard is the one ``kvrouter top`` runs (``TopApp`` over ``LocalFeed``), driven tick by tick
through Pilot; only the router is live. Waits are bounded polls for a condition, never a timed assert.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static

from kvrouter.index.sweep import sweep_leftovers
from tests.service.test_up import START_TIMEOUT_S, URL_LINE, Up, descendants, start_up, still_there
from tui.app import TopApp
from tui.feed import LocalFeed
from tui.screens import NotThereScreen

__all__ = ["start_up"]  # the fixture, imported for this module's tests

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


async def test_top_follows_a_live_router_then_says_it_is_gone_when_killed(
    start_up: Callable[..., Up], tmp_path: Path, shm_entries: Callable[[int], list[str]]
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    up = start_up("--mock-workers", "2", "--shards", "1", "--client-rate", "8", env={"XDG_RUNTIME_DIR": str(runtime)})
    up.expect(URL_LINE, START_TIMEOUT_S)
    up.expect(BANNER, START_TIMEOUT_S)
    app = TopApp(LocalFeed(directory=runtime / "kvrouter"), manual=True)
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

        tree = descendants(up.proc.pid)
        try:
            up.proc.send_signal(signal.SIGKILL)  # no shutdown: its discovery file and segments stay behind
            up.proc.wait()
            await until(app, lambda: isinstance(app.screen, NotThereScreen), timeout=30)
            await pilot.pause()
            assert app.router_gone
            text = str(app.screen.query_one("#not-there-text", Static).content)
            assert "router not there" in text
            assert f"pid {up.proc.pid}" in text
        finally:
            kill_and_sweep(tree)
    assert shm_entries(up.proc.pid) == []


def kill_and_sweep(tree: list[tuple[int, str]]) -> None:
    """What a SIGKILLed ``kvrouter up`` leaves: its children, then its segments (as the next engine's
    start sweeps them)."""
    for pid in still_there(tree):  # its mock engines, fork server and appliers
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while still_there(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    sweep_leftovers()
