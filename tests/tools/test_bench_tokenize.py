"""``tools/bench_tokenize.py`` in its short form: a 12-turn conversation, each turn's tokens compared with a
full encode inside the tool (it exits non-zero on a difference), the per-turn figures and the ratio written;
then the routing path's report-only line, both servers answering every request (the tool exits non-zero on
an error)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.tools.runner import run_tool


def test_the_tool_times_both_ways_and_writes_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    stdout, _ = run_tool(
        "bench_tokenize.py",
        *("--turns", "12", "--tokens", "8000", "--repeats", "1", "--route-seconds", "0", "--json", str(out)),
    )
    assert "incremental: full / kvrouter, median over turns 3-12" in stdout
    document = json.loads(out.read_text())
    assert len(document["turns"]) == 12
    assert document["headline_turns"] == [3, 12]
    assert set(document["ratios"]) == {"incremental", "incremental_encode"}
    assert document["ratios"]["incremental"] > 0
    assert 6000 < document["turns"][-1]["prompt_tokens"] < 10000  # the conversation's size, as asked
    assert set(document["summary"]) == {"kvrouter", "full"}


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (tools/install_wrk.sh)")
def test_the_routing_path_line_runs_kvrouters_chat_beside_the_references_select(tmp_path: Path) -> None:
    pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")
    out = tmp_path / "tokenize.json"
    stdout, _ = run_tool(
        "bench_tokenize.py",
        *("--turns", "6", "--tokens", "3000", "--repeats", "1", "--route-seconds", "1", "--route-rounds", "1"),
        *("--json", str(out)),
        timeout=300,
    )
    assert "routing path (report only): kvrouter /v1/chat/completions" in stdout
    document = json.loads(out.read_text())
    route = document["route"]
    assert route["kvrouter_chat_rps"] > 0
    assert route["reference_select_rps"] > 0
    assert [len(route["points"][side]) for side in ("kvrouter", "reference")] == [1, 1]
    assert document["ratios"]["chat_route"] == route["ratio"] > 0
