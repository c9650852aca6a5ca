"""``tools/bench_disagg.py`` end to end on each trace's first 200 requests: its table, its goals and its JSON
ratios. The whole grid is the tool's (minutes on two cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.runner import TRACES, run_tool


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"traces not found at {TRACES}")
def test_the_grid_reports_every_run_goal_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    stdout, _ = run_tool(
        "bench_disagg.py",
        *("--limit", "200", "--jobs", "2", "--json", str(out)),
    )
    assert "| conversation | x4 | 4P+4D | kvrouter_disagg |" in stdout
    assert "| synthetic | x1.5 (held out) | 8 aggregated | kvrouter |" in stdout
    figures = json.loads(out.read_text())
    assert len(figures["rows"]) == 4 * (2 * 4 + 1)  # 4 speeds x (2 fleets x 4 policies + the aggregated fleet)
    assert len(figures["goals"]) == 2 * 2 * 3 + 2 * 2 * 2  # the conversation trace has the always-split goal too
    assert figures["failed"] == sum(not goal["passed"] for goal in figures["goals"])
    assert set(figures["ratios"]) == {"ttft_p90_vs_dynamo_disagg", "itl_p90_vs_aggregated"}
    assert all(ratio > 0 for ratio in figures["ratios"].values())
    aggregated = [row for row in figures["rows"] if row["fleet"] == "8 aggregated"]
    assert {row["bytes_transferred"] for row in aggregated} == {0}
