"""``tools/bench_index.py`` runs end to end on a tiny workload, writes the JSON it promises, and leaves
nothing of its engines in ``/dev/shm`` or the temporary folder. Speed is not asserted (STYLE.md: speed
claims are the tool's ratios from one run, not test conditions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tools.runner import left_behind, run_tool

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")

TOOL = "bench_index.py"
RATIOS = {"find_matches_64", "find_matches_512", "apply", "two_readers_scaling"}


def test_quick_run_reports_every_ratio(tmp_path: Path) -> None:
    stdout, pid = run_tool(TOOL, "--quick", "--json", str(tmp_path / "figures.json"))
    figures: dict[str, Any] = json.loads((tmp_path / "figures.json").read_text())
    assert set(figures["ratios"]) == RATIOS
    assert all(value > 0 for value in figures["ratios"].values())
    assert "1 shard" in figures["ratio_basis"]
    for config in figures["configs"].values():
        assert set(config["shards"]) == {"1", "2", "4"}
        for row in config["shards"].values():
            assert row["bytes_per_block"] > 0
            for length in ("64", "512"):
                assert row["find_matches"][length]["mismatches"] == 0
                assert row["find_matches"][length]["compared"] >= 200
    assert figures["machine"]["before"]["loadavg"]
    assert "load average" in stdout
    assert "shm: clean" in stdout
    assert left_behind(pid) == []


def test_capacity_mode_reports_bytes_per_block(tmp_path: Path) -> None:
    stdout, pid = run_tool(
        TOOL,
        "--capacity",
        "--capacity-blocks",
        "20000",
        "--capacity-workers",
        "64",
        "--json",
        str(tmp_path / "capacity.json"),
    )
    capacity = json.loads((tmp_path / "capacity.json").read_text())["capacity"]
    assert capacity["blocks"] == 20000
    assert capacity["keys"] == 20000
    assert capacity["chains_missing"] == 0
    assert capacity["bytes_per_block"] > 0
    assert "not run" in capacity["reference"]
    assert "bytes per cached block" in stdout
    assert left_behind(pid) == []
