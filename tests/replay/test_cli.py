"""``kvrouter replay``'s flags: every drill of the issue is built; an unknown one is a usage error (exit 2)."""

from __future__ import annotations

from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.cli.replay import parse_drills
from kvrouter.replay import DRILLS, NOT_BUILT

runner = CliRunner()


def test_every_drill_of_the_issue_is_built():
    issue = {"gap", "engine-restart", "applier-kill", "router-restart", "worker-churn", "slow-consumer",
             "nats-outage", "replica-kill"}  # fmt: skip
    assert set(DRILLS) == issue
    assert NOT_BUILT == ()
    assert "not built" not in runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "200"}).output


def test_an_unknown_drill_is_a_usage_error_listing_the_drills():
    result = runner.invoke(app, ["replay", "--drill", "gapp"])
    assert result.exit_code == 2
    assert "unknown drill" in result.output


def test_all_or_nothing_means_every_drill_built_in_the_issues_order():
    issue_order = ("gap", "engine-restart", "applier-kill", "worker-churn", "router-restart", "slow-consumer",
                   "nats-outage", "replica-kill")  # fmt: skip
    assert parse_drills(None) == parse_drills("all") == tuple(DRILLS) == issue_order
    assert parse_drills(" applier-kill, gap ,gap") == ("applier-kill", "gap")


def test_more_requests_than_the_trace_holds_is_a_usage_error():
    result = runner.invoke(app, ["replay", "--requests", "2001"])
    assert result.exit_code == 2
