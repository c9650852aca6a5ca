"""``kvrouter replay``'s flags: drills not built yet and unknown ones are usage errors (exit 2) naming them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.cli.replay import parse_drills
from kvrouter.replay import DRILLS, NOT_BUILT

runner = CliRunner()


@pytest.mark.parametrize("name", NOT_BUILT)
def test_a_drill_not_built_is_a_usage_error_that_says_so(name):
    result = runner.invoke(app, ["replay", "--drill", f"gap,{name}"])
    assert result.exit_code == 2
    assert "not built yet" in result.output
    assert name in result.output


def test_an_unknown_drill_is_a_usage_error_listing_the_drills():
    result = runner.invoke(app, ["replay", "--drill", "gapp"])
    assert result.exit_code == 2
    assert "unknown drill" in result.output


def test_all_or_nothing_means_every_drill_built_in_the_issues_order():
    issue_order = ("gap", "engine-restart", "applier-kill", "worker-churn", "router-restart", "slow-consumer")
    assert parse_drills(None) == parse_drills("all") == tuple(DRILLS) == issue_order
    assert parse_drills(" applier-kill, gap ,gap") == ("applier-kill", "gap")


def test_more_requests_than_the_trace_holds_is_a_usage_error():
    result = runner.invoke(app, ["replay", "--requests", "2001"])
    assert result.exit_code == 2
