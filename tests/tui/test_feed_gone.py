"""A service stopped under both feeds: they raise ``RouterGone``, and the discovery dir and ``/dev/shm``
are left clean (``serving`` asserts the latter for this process's names)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvrouter.index.layout import SHM_DIR
from kvrouter.routing.config import RouterConfig
from kvrouter.service import ServiceConfig
from tests.service.conftest import serving
from tui.feed import HttpFeed, ShmFeed, discover
from tui.model import RouterGone

pytestmark = pytest.mark.timeout(300)  # the first test starts the service: cold caches compile


def test_feeds_say_the_router_is_gone_once_it_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_until: Any):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    runtime = tmp_path / "kvrouter"
    config = ServiceConfig(port=0, shards=1, health_interval_secs=0.1, drain_secs=1.0, router=RouterConfig())
    shm: ShmFeed | None = None
    try:
        with serving(config, tmp_path) as running:
            (entry,) = discover(runtime)
            shm = ShmFeed.of(entry)
            http = HttpFeed(running.url)
            wait_until(lambda: len(shm.poll().workers) == 2, what="the shm feed sees both workers")
            assert len(http.poll().workers) == 2
        with pytest.raises(RouterGone, match="not in /dev/shm"):
            shm.poll()
        with pytest.raises(RouterGone):
            http.poll()
        with pytest.raises(RouterGone):
            shm.probe([1, 2, 3])
    finally:
        if shm is not None:
            shm.close()
    assert discover(runtime) == []
    assert os.listdir(runtime) == []
    assert not os.path.exists(f"{SHM_DIR}/{entry.stats}")
