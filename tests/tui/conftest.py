"""Fixtures for the dashboard's tests: the environment Textual snapshots need, and a fake feed.

``NO_COLOR`` set in the environment changes every SVG snapshot, and ``TEXTUAL=devtools`` makes the app
try to reach a devtools console (spec §4.2, measured with textual 8.2.8): both are cleared for every
test here.

Pilot tests are ``async def``; the hook below runs them with ``asyncio.run`` (as the service tests
run their event loops), rather than adding an async plugin to the dev dependencies for one folder.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from tests.tui.fake_feed import FakeFeed


@pytest.fixture(autouse=True)
def _textual_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TEXTUAL", raising=False)


@pytest.fixture
def fake_feed() -> FakeFeed:
    feed = FakeFeed()
    feed.step()
    return feed


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(pyfuncitem.obj(**arguments))
    return True
