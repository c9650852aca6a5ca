"""``tools/bench_decide.py`` runs end to end on a small fleet, writes the JSON it promises, agrees with the
oracle on every checked decision, and leaves nothing of its engine in ``/dev/shm``. Speed is not asserted
(STYLE.md: speed claims are the tool's ratios from one run, not test conditions)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.tools.runner import run_tool

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")

SIDES = {"new", "oracle", "walk", "reference_find_matches"}


def test_quick_run_reports_every_ratio_and_agrees_with_the_oracle(tmp_path: Path) -> None:
    out = tmp_path / "decide.json"
    stdout, pid = run_tool(
        "bench_decide.py",
        *("--quick", "--workers", "16", "64", "--queries", "60", "--json", str(out)),
    )
    figures: dict[str, Any] = json.loads(out.read_text())
    assert set(figures["ratios"]) == {"speedup", "overhead", "scale"}
    assert all(value > 0 for value in figures["ratios"].values())
    assert set(figures["configs"]) == {"16", "64"}
    for lengths in figures["configs"].values():
        assert set(lengths) == {"64", "512"}
        for row in lengths.values():
            assert set(row) >= SIDES
            assert row["disagreements"] == 0
            assert row["checked"] > 0
            for side in SIDES:
                assert set(row[side]) == {"p50_us", "p99_us", "per_s", "samples"}
    assert "shm: clean" in stdout
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvrouter-{pid}-")]
