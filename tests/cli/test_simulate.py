"""``kvrouter simulate`` end to end on the packaged sample: two policies, a small fleet, a few hundred
requests, with ``--json`` and ``--plot``; usage errors for unknown policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.sim.policies import POLICIES
from kvrouter.sim.policies.disagg import DISAGG_POLICIES
from kvrouter.sim.report import DISAGG_JSON_KEYS, JSON_KEYS

runner = CliRunner()

SMALL = ["simulate", "--workers", "2", "--limit", "300", "--policy", "round_robin,dynamo_t0"]


def test_runs_on_the_sample_and_writes_json_and_plot(tmp_path: Path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    result = runner.invoke(app, [*SMALL, "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "mooncake_conversation_2000.jsonl: 300 requests, 2 workers" in result.output
    lines = result.output.splitlines()
    assert any(line.startswith("mooncake_conversation_2000.jsonl") and "round_robin" in line for line in lines)
    assert any("dynamo_t0" in line and "x" in line for line in lines)
    rows = json.loads(out.read_text())["rows"]
    assert [row["policy"] for row in rows] == ["round_robin", "dynamo_t0"]
    for row in rows:
        assert tuple(row) == JSON_KEYS
        assert row["workers"] == 2
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"] <= row["ttft_ms"]["p99"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_same_rows(tmp_path: Path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        result = runner.invoke(app, [*SMALL, "--seed", "7", "--json", str(path)])
        assert result.exit_code == 0, result.output

    def without_timing(path: Path) -> list[dict[str, object]]:
        return [{k: v for k, v in row.items() if k != "decision_us"} for row in json.loads(path.read_text())["rows"]]

    assert without_timing(first) == without_timing(second)


def test_unknown_policy_is_a_usage_error_naming_the_choices():
    result = runner.invoke(app, ["simulate", "--policy", "round_robin,fastest"])
    assert result.exit_code == 2
    assert "fastest" in result.output
    for name in POLICIES:
        assert name in result.output


def test_a_bad_trace_line_is_reported_and_the_rest_runs(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    good = '{"timestamp": %d, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 2]}'
    trace.write_text("\n".join([good % 0, "{broken", good % 100]) + "\n")
    result = runner.invoke(app, ["simulate", "--trace", str(trace), "--workers", "2", "--policy", "round_robin"])
    assert result.exit_code == 0, result.output
    assert "skipped 1 bad line(s) of trace.jsonl; first: line 2" in result.output
    assert "trace.jsonl: 2 requests" in result.output


def test_help_shows_units_defaults_env_vars_and_an_example():
    result = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for text in ("--workers", "[workers]", "[ms]", "KVROUTER_SIM_WORKERS", "default: 4", "Examples", "Workload"):
        assert text in result.output


FANOUT = ["simulate", "--workload", "fanout", "--workers", "4", "--speedup", "5", "--policy", "round_robin,kvrouter"]


def test_a_generated_workload_runs_and_its_written_trace_replays_to_the_same_rows(tmp_path: Path):
    trace, generated, replayed = tmp_path / "fanout.jsonl", tmp_path / "a.json", tmp_path / "b.json"
    result = runner.invoke(
        app, [*FANOUT, "-o", "requests=200", "-o", "seed=4", "--write-trace", str(trace), "--json", str(generated)]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {trace}" in result.output
    assert "fanout[seed=4,requests=200]: 200 requests, 4 workers, arrivals x5" in result.output
    assert len(trace.read_text().splitlines()) == 200
    result = runner.invoke(app, [*FANOUT[:1], *FANOUT[3:], "--trace", str(trace), "--json", str(replayed)])
    assert result.exit_code == 0, result.output

    def figures(path: Path) -> list[dict[str, object]]:
        return [
            {k: v for k, v in row.items() if k not in ("decision_us", "trace")}
            for row in json.loads(path.read_text())["rows"]
        ]

    assert figures(generated) == figures(replayed)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "agents"], "unknown workload 'agents'; choose from: fanout, rag, chat"),
        (["--workload", "rag", "-o", "colour=blue"], "valid (with defaults): seed=0"),
        (["--workload", "rag", "-o", "docs_min=4"], "docs_max (3) must be >= docs_min (4)"),
        (["-o", "seed=1"], "needs --workload"),
        (["--write-trace", "x.jsonl"], "needs --workload"),
    ],
)
def test_workload_usage_errors_say_what_is_wrong(args: list[str], message: str):
    result = runner.invoke(app, ["simulate", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


def test_a_trace_and_a_workload_are_not_both_taken(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    result = runner.invoke(app, ["simulate", "--trace", str(trace), "--workload", "rag"])
    assert result.exit_code == 2
    assert "give --trace or --workload, not both" in " ".join(result.output.replace("│", " ").split())


DISAGG = ["simulate", "--prefill-workers", "2", "--decode-workers", "2", "--speedup", "4", "--limit", "200"]


def test_a_disaggregated_run_compares_every_policy_with_the_aggregated_fleet(tmp_path: Path):
    out = tmp_path / "disagg.json"
    result = runner.invoke(app, [*DISAGG, "--json", str(out)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "2P+2D against 4 aggregated workers" in result.output
    assert "131072 B/token at 200 Gbit/s in a domain, 25 across (1 domains), +2 ms each" in result.output
    rows = json.loads(out.read_text())["rows"]
    assert [row["policy"] for row in rows] == [*DISAGG_POLICIES, "kvrouter"]
    for row in rows[:-1]:
        assert tuple(row) == DISAGG_JSON_KEYS
        assert set(row["itl_ms"]) == {"p50", "p90"}
        assert (row["prefill_workers"], row["decode_workers"], row["workers"]) == (2, 2, 4)
    assert tuple(rows[-1]) == JSON_KEYS  # the aggregated row keeps today's keys exactly
    assert set(rows[-1]["itl_ms"]) == {"p50"}
    assert rows[-1]["workers"] == 4
    by_policy = {row["policy"]: row for row in rows}
    assert by_policy["kvrouter_always_split"]["local_prefill_share"] == 0.0
    assert by_policy["kvrouter_disagg"]["local_prefill_share"] > 0.0


def test_the_transfer_options_reach_the_simulation(tmp_path: Path):
    """A slower link and a larger fixed cost per transfer: every split request waits longer for its first token,
    and a decode worker across domains is avoided (rule 2's link factor) while one in the prefill's is free."""
    paths = {name: tmp_path / f"{name}.json" for name in ("default", "slow", "domains")}
    base = [*DISAGG, "--policy", "kvrouter_always_split"]
    extras = {
        "default": [],
        "slow": ["--kv-transfer-gbps-local", "50", "--transfer-overhead-ms", "1000"],
        "domains": ["--domains", "2", "--kv-transfer-gbps", "0.5"],
    }
    rows = {}
    for name, extra in extras.items():
        result = runner.invoke(app, [*base, *extra, "--json", str(paths[name])])
        assert result.exit_code == 0, result.output
        rows[name] = json.loads(paths[name].read_text())["rows"][0]
    assert rows["slow"]["ttft_ms"]["p50"] > rows["default"]["ttft_ms"]["p50"] + 1000
    assert rows["domains"]["ttft_ms"]["p50"] < rows["slow"]["ttft_ms"]["p50"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-workers", "2"], "give --prefill-workers and --decode-workers together"),
        (["--policy", "kvrouter_disagg"], "unknown policy 'kvrouter_disagg'"),  # aggregated: no such policy
        (["--prefill-workers", "1", "--decode-workers", "1", "--policy", "nope"], "kvrouter_always_split"),
    ],
)
def test_disaggregated_usage_errors_say_what_is_wrong(args: list[str], message: str):
    result = runner.invoke(app, ["simulate", *args], env={"COLUMNS": "250"})
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
