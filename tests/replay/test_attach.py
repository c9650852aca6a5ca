"""``kvrouter replay --url``: attached to a running router whose workers are mock engines, the drills that
only need HTTP run and the ones needing local processes are reported skipped, not failed."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvrouter.cli import app

runner = CliRunner()


def test_attached_runs_the_http_drills_and_skips_the_process_ones(stack, tmp_path):
    _loop, local = stack
    out = tmp_path / "attached.json"
    names = "gap,applier-kill,slow-consumer,replica-kill,prefill-kill"
    args = ["replay", "--url", local.url, "--drill", names, "--requests", "16", "--speed", "8"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    drills = {d["drill"]: d for d in json.loads(out.read_text())["drills"]}
    assert drills["gap"]["status"] == "ok"
    assert drills["gap"]["gaps"]["detected"] >= 1
    for name in ("applier-kill", "slow-consumer", "replica-kill", "prefill-kill"):  # processes to signal or start
        assert drills[name]["status"] == "skipped"
        assert drills[name]["reason"] == "needs local processes (not with --url)"
        assert f"{name} skipped" in result.output
