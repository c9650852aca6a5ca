"""Fixtures for the dashboard's tests: the environment Textual snapshots need, and a fake feed.

``NO_COLOR`` set in the environment changes every SVG snapshot, and ``TEXTUAL=devtools`` makes the app
try to reach a devtools console (spec §4.2, measured with textual 8.2.8): both are cleared for every
test here.
"""

from __future__ import annotations

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
