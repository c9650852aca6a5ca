"""``tools/bench_service.py --quick`` runs end to end: both servers route on the same events (the tool
checks it before any clock runs), every point answers without an error, the ratios' point is measured in
the rounds asked for, and the JSON carries both ratios.
Speed is not asserted (speed claims are the tool's ratios from one run, not test conditions)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.tools.runner import run_tool

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")
if shutil.which("wrk") is None:
    pytest.skip("wrk is not installed (tools/install_wrk.sh)", allow_module_level=True)


def test_quick_run_measures_both_servers_and_reports_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run_tool("bench_service.py", "--quick", "--rounds", "2", "--json", str(out), timeout=400)
    figures: dict[str, Any] = json.loads(out.read_text())
    assert set(figures["ratios"]) == {"select_throughput", "select_p99"}
    assert all(value > 0 for value in figures["ratios"].values())
    for side in ("reference", "kvrouter"):
        points = figures["points"][side]
        assert set(points) == {"1", "8", "64"}
        assert all(p["requests"] > 0 and p["errors"] == 0 for p in points.values())
        rounds = figures["rounds"][side]  # the ratios' point, measured twice; the row is their median
        assert len(rounds) == 2
        assert points["8"]["rounds"] == 2
        assert points["8"]["requests"] == sum(p["requests"] for p in rounds)
    fast = figures["fastpath"]["points"]  # the ZMQ fast path, kvrouter only
    assert set(fast) == {"1", "8"}
    assert all(p["requests"] > 0 and p["errors"] == 0 for p in fast.values())
    assert figures["fastpath"]["generator_ceiling"]["requests"] > 0
    assert figures["shm_left"] == []
