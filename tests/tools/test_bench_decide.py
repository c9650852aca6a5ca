"""``tools/bench_decide.py`` runs end to end on a small fleet, writes the JSON it promises, agrees with the
oracle on every checked decision, and leaves nothing of its engine in ``/dev/shm``. Speed is not asserted
(STYLE.md: speed claims are the tool's ratios from one run, not test conditions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_decide.py"
SIDES = {"new", "oracle", "walk", "reference_find_matches"}


def test_quick_run_reports_every_ratio_and_agrees_with_the_oracle(tmp_path: Path) -> None:
    out = tmp_path / "decide.json"
    process = subprocess.Popen(
        [sys.executable, str(TOOL), "--quick", "--workers", "16", "64", "--queries", "60", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's kvrouter, not an installed one
    )
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr
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
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvrouter-{process.pid}-")]
