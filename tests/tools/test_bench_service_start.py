"""``tools/bench_service.py``'s servers are its own to stop even when they do not come up: a kvrouter that
answers ``/health`` but never gets ready is stopped before the error leaves ``start_kvrouter``, with its
segments. Needs neither wrk nor the reference (``test_bench_service.py`` needs both)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.tools.runner import TOOLS


def _bench_service(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_service_under_test", TOOLS / "bench_service.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_kvrouter_that_never_gets_ready_is_stopped_with_its_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _bench_service(monkeypatch)
    real_wait = bench.wait_http
    started: list[Any] = []

    def ready_never(server: Any, path: str, timeout: float, *_: Any) -> None:
        started.append(server)
        real_wait(server, "/health", timeout)  # up and serving, segments made...
        raise SystemExit(f"bench_service: {server.name} did not answer /ready")  # ...and never ready

    monkeypatch.setattr(bench, "wait_http", ready_never)
    try:
        with pytest.raises(SystemExit, match="did not answer /ready"):
            bench.start_kvrouter(tmp_path, 1)
        (server,) = started
        assert server.process.returncode == 0  # stopped by SIGTERM and reaped, not left serving
    finally:
        for left in started:
            bench.stop(left)  # a no-op once stopped; a failing run leaves nothing either
    pid = server.process.pid
    assert [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-")] == []
