"""``tools/bench_routing_held_out.py`` end to end on one small held-out run (six workers, the synthetic trace):
its table, its JSON and its bars. The whole set is the tool's, not the tests' (minutes on two cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.runner import TRACES, run_tool


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"traces not found at {TRACES}")
def test_one_held_out_run_passes_its_bars(tmp_path: Path) -> None:
    out = tmp_path / "held_out.json"
    stdout, _ = run_tool(
        "bench_routing_held_out.py",
        *("--runs", "S6 x1.5", "--jobs", "2", "--json", str(out), "--check"),
    )
    assert "| S6 x1.5 |" in stdout
    assert "0 bar(s) failed" in stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row) == {"run", "round_robin", "dynamo_t0", "kvrouter", "bars"}
    assert [bar["passed"] for bar in row["bars"]] == [True, True, True]
    assert row["kvrouter"]["hit_rate"] > row["round_robin"]["hit_rate"]
