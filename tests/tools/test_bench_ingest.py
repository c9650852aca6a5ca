"""``tools/bench_ingest.py`` runs end to end on a tiny workload: every frame sent over its real ZMQ sockets is
applied (no gap, no bad frame, every event counted in the workers' rows), the index answers as the reference
does, the freshness reader sees every sequence, and the JSON carries both ratios. Speed is not asserted
(STYLE.md: speed claims are the tool's ratios from one run, not test conditions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tools.runner import left_behind, run_tool

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")

RATIOS = {"ingest", "ingest_vllm"}


def test_quick_run_applies_every_frame_and_reports_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    stdout, pid = run_tool("bench_ingest.py", "--quick", "--json", str(out))
    figures: dict[str, Any] = json.loads(out.read_text())
    assert set(figures["ratios"]) == RATIOS
    assert set(figures["goals"]) == RATIOS
    assert all(value > 0 for value in figures["ratios"].values())
    assert "1 shard" in figures["ratio_basis"]
    for config in figures["configs"].values():
        assert set(config["formats"]) == {"kvrouter", "vllm"}
        for ways in config["receive_us_per_message"].values():  # the receive's cost, both ways, was measured
            assert set(ways) == {"compiled", "recv_multipart"}
            assert all(us > 0 for us in ways.values())
        for by_shards in config["formats"].values():
            assert set(by_shards) == {"1", "2"}
            for row in by_shards.values():
                assert row["events_applied"] == [config["events"]] * len(row["events_applied"])
                assert row["gaps_detected"] == 0
                assert row["bad_frames"] == 0
                assert row["problems"] == []
                assert row["mismatches"] == 0
                assert row["compared"] >= 200
                assert set(row["cpu_s"]) == {"sender", "applier", "applier_zmq_io", "growth_helpers"}
                assert all(seconds >= 0 for seconds in row["cpu_s"].values())
    rows = [row for c in figures["configs"].values() for f in c["formats"].values() for row in f.values()]
    assert sum(row["cpu_s"]["applier"] for row in rows) > 0  # the appliers' main threads were found and did the work
    freshness = figures["freshness"]
    assert freshness["missing"] == 0
    assert freshness["sequences"] > 0
    assert freshness["p50_us"] <= freshness["p99_us"]
    assert figures["machine"]["before"]["loadavg"]
    assert "load average" in stdout
    assert "receive, vllm frames" in stdout
    assert "CPU during the run" in stdout
    assert "shm: clean" in stdout
    assert left_behind(pid) == []


def test_wire_run_feeds_both_services_and_reports_the_wire_ratios(tmp_path: Path) -> None:
    """``--wire``: the same frames into ``kvrouter up`` (1 and 2 shards) and ``dynamo.indexer``, each shown
    every publisher's last sequence, with a rate, ``/query`` latencies and a memory figure for each."""
    out = tmp_path / "figures.json"
    stdout, pid = run_tool("bench_ingest.py", "--quick", "--wire", "--json", str(out), timeout=400)
    figures: dict[str, Any] = json.loads(out.read_text())
    assert {"wire_burst_1", "wire_burst_2", "wire_bytes_per_block"} <= set(figures["ratios"])
    assert set(figures["goals"]) == set(figures["ratios"])
    (row,) = figures["wire"].values()
    for side in ("kvrouter-1", "kvrouter-2", "reference"):
        assert row[side]["blocks_per_s"] > 0
        assert row[side]["query_ms"]["n"] >= 4  # at least one query per publisher
    assert row["kvrouter-1"]["bytes_per_block"] > 0
    (steady,) = figures["wire_lag"].values()  # --quick: 100k blocks/s only
    for side in ("kvrouter-1", "kvrouter-2", "reference"):
        assert steady[side]["never_visible"] == 0
        assert steady[side]["lag_ms"]["n"] == steady[side]["watched"] > 0
        assert steady[side]["cpu_s"] > 0  # the service worked to ingest: its processes' CPU was read
    for side in ("kvrouter-1", "kvrouter-2"):  # a reader of kvrouter's own index, filed by growth or not
        assert steady[side]["read_steady_us"]["n"] > 0
        assert "read_growth_us" in steady[side]  # none in a run whose tables never grew
        assert steady[side]["read_wrong"] == 0
    assert "read_steady_us" not in steady["reference"]
    assert "wire: vLLM frames over ZMQ" in stdout
    assert "wire lag:" in stdout
    assert "µs a block" in stdout
    assert "find_matches during a table's growth" in stdout
    assert left_behind(pid) == []
