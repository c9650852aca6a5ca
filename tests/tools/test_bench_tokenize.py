"""``tools/bench_tokenize.py`` in its short form: a 12-turn conversation, each turn's tokens compared with a
full encode inside the tool (it exits non-zero on a difference), the per-turn figures and the ratio written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.tools.runner import run_tool

ROOT = Path(__file__).resolve().parents[2]


def test_the_tool_times_both_ways_and_writes_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    stdout, _ = run_tool(
        "bench_tokenize.py",
        *("--turns", "12", "--tokens", "8000", "--repeats", "1", "--json", str(out)),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert "incremental: full / kvrouter, median over turns 3-12" in stdout
    document = json.loads(out.read_text())
    assert len(document["turns"]) == 12
    assert document["headline_turns"] == [3, 12]
    assert set(document["ratios"]) == {"incremental", "incremental_encode"}
    assert document["ratios"]["incremental"] > 0
    assert 6000 < document["turns"][-1]["prompt_tokens"] < 10000  # the conversation's size, as asked
    assert set(document["summary"]) == {"kvrouter", "full"}
