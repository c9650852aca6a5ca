"""``tools/tune_disagg_rule.py`` in its short form (100 requests per run): every run of the grid and outside it
under every pair of thresholds, as a table and as JSON. The whole sweep is the tool's (about a minute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.runner import TRACES, run_tool


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"traces not found at {TRACES}")
def test_every_run_gets_every_pair(tmp_path: Path) -> None:
    out = tmp_path / "rule.json"
    stdout, _ = run_tool(
        "tune_disagg_rule.py",
        *("--limit", "100", "--jobs", "2", "--json", str(out)),
    )
    assert "| run | 512, off | 2,048, off | 2,048, 16,384 | 512, 16,384 |" in stdout
    assert "| C x4 4P+4D, requests 6,001- (held out) |" in stdout
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 10 * 4
    assert {(r["max_local_prefill_tokens"], r["prefill_busy_tokens"]) for r in runs} == {
        (512, None), (2048, None), (2048, 16384), (512, 16384)
    }  # fmt: skip
    assert all(0.0 <= r["local_prefill_share"] <= 1.0 and r["ttft_p90_ms"] > 0 for r in runs)
    # a lower bar for local prefill never prefills more locally, other things equal
    by_run: dict[str, dict[tuple[int, int | None], float]] = {}
    for r in runs:
        by_run.setdefault(r["run"], {})[(r["max_local_prefill_tokens"], r["prefill_busy_tokens"])] = r[
            "local_prefill_share"
        ]
    for shares in by_run.values():
        assert shares[(512, None)] <= shares[(2048, None)]
