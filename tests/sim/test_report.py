"""``kvrouter.sim.report``: exact JSON keys, xRR only within a group that has round robin, and a PNG."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvrouter.sim.report import (
    DISAGG_JSON_KEYS,
    JSON_KEYS,
    Disagg,
    ReportRow,
    format_table,
    hit_ratios,
    rich_table,
    to_json,
    write_json,
)


def row(policy: str, hit: float, *, trace: str = "conv", workers: int = 4, ceiling: float | None = 0.2) -> ReportRow:
    return ReportRow(
        trace=trace,
        workers=workers,
        speedup=2.0,
        policy=policy,
        hit_rate=hit,
        ttft_p50_ms=100.0,
        ttft_p90_ms=300.0,
        ttft_p99_ms=900.0,
        itl_p50_ms=12.5,
        imbalance=1.02,
        decision_p50_us=20.0,
        decision_p99_us=80.0,
        ceiling=ceiling,
        ttfts_ms=(50.0, 100.0, 300.0, 900.0),
    )


def test_json_keys_are_exact():
    out = to_json(row("kvrouter", 0.15))
    assert tuple(out) == JSON_KEYS
    assert set(out) == {
        "trace",
        "workers",
        "speedup",
        "policy",
        "hit_rate",
        "ttft_ms",
        "itl_ms",
        "imbalance",
        "decision_us",
        "ceiling_fraction",
    }
    assert out["ttft_ms"] == {"p50": 100.0, "p90": 300.0, "p99": 900.0}
    assert out["itl_ms"] == {"p50": 12.5}
    assert out["decision_us"] == {"p50": 20.0, "p99": 80.0}
    assert out["ceiling_fraction"] == pytest.approx(0.75)


def test_no_ceiling_gives_null_fraction(tmp_path: Path):
    path = tmp_path / "rows.json"
    write_json([row("random", 0.1, ceiling=None)], path, seed=3)
    written = json.loads(path.read_text())
    assert written["seed"] == 3
    assert written["rows"][0]["ceiling_fraction"] is None


def test_ratios_only_within_a_group_with_round_robin():
    rows = [row("round_robin", 0.08), row("kvrouter", 0.16), row("kvrouter", 0.3, trace="synthetic")]
    assert hit_ratios(rows) == [pytest.approx(1.0), pytest.approx(2.0), None]


def test_plain_table_has_the_ratio_column_only_when_it_means_something():
    with_rr = format_table([row("round_robin", 0.08), row("kvrouter", 0.16)])
    assert "xRR" in with_rr.splitlines()[0]
    assert "x2.00" in with_rr.splitlines()[2]
    without = format_table([row("kvrouter", 0.16)])
    assert "xRR" not in without
    assert "80%" in without  # 0.16 of a 0.2 ceiling


def test_rich_table_has_a_row_per_result():
    table = rich_table([row("round_robin", 0.08), row("kvrouter", 0.16), row("kvrouter", 0.3, workers=8)])
    assert table.row_count == 3


def test_plot_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from kvrouter.sim.report import write_plot

    path = tmp_path / "plot.png"
    write_plot([row("round_robin", 0.08), row("kvrouter", 0.16)], path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from kvrouter.sim.report import write_plot

    with pytest.raises(RuntimeError, match=r"kvrouter\[plot\]"):
        write_plot([row("kvrouter", 0.1)], tmp_path / "p.png")


def test_a_disaggregated_row_adds_its_keys_and_an_aggregated_one_keeps_todays():
    aggregated = dataclasses.replace(row("kvrouter", 0.2), itl_p90_ms=20.0)  # shown in the table, not the JSON
    disagg = dataclasses.replace(
        row("kvrouter_disagg", 0.15),
        itl_p90_ms=18.0,
        disagg=Disagg(
            prefill_workers=2,
            decode_workers=2,
            output_tokens_per_s=900.0,
            bytes_transferred=3_000_000_000,
            local_prefill_share=0.25,
        ),
    )
    assert tuple(to_json(aggregated)) == JSON_KEYS
    assert to_json(aggregated)["itl_ms"] == {"p50": 12.5}
    out = to_json(disagg)
    assert tuple(out) == DISAGG_JSON_KEYS
    assert out["itl_ms"] == {"p50": 12.5, "p90": 18.0}
    assert (out["prefill_workers"], out["decode_workers"], out["bytes_transferred"]) == (2, 2, 3_000_000_000)
    assert (out["output_tokens_per_s"], out["local_prefill_share"]) == (900.0, 0.25)
    text = format_table([disagg, aggregated])
    header, first, second = text.splitlines()
    assert header.split()[-7:] == ["ITL", "p90", "out", "tok/s", "moved", "GB", "local"]
    assert first.split()[-4:] == ["18.00", "900", "3.0", "25%"]
    assert second.split()[-1] == "20.00"  # the aggregated row: its ITL p90, nothing to transfer
    assert "ITL p90" not in format_table([row("kvrouter", 0.2)])  # an aggregated comparison is as before
