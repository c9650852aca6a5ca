"""``tools/bench_growth.py`` runs end to end on a small burst that still grows the tables, writes the JSON it
promises with every reader answer right, and leaves nothing in ``/dev/shm``. Speed is not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.runner import left_behind, run_tool

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")


def test_quick_run_reports_both_ratios_and_right_answers(tmp_path: Path) -> None:
    stdout, pid = run_tool("bench_growth.py", "--quick", "--json", str(tmp_path / "figures.json"))
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert set(figures["ratios"]) == {"burst", "read_p999_burst", "bytes_per_block"}
    assert figures["ratios"]["burst"] > 0
    assert figures["ratios"]["read_p999_burst"] > 0
    ours = figures["kvrouter"]
    assert ours["bytes_per_block"] > 48  # at least a table slot per block
    assert ours["wrong_answers"] == 0
    assert ours["read_burst_us"]["n"] > 0
    assert ours["table_slots"] > 1 << 16  # the burst grew the table past its first size
    assert figures["reference"]["read_burst_us"]["n"] > 0
    assert "shm: clean" in stdout
    assert left_behind(pid) == []
