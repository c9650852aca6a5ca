"""``kvrouter replay``'s flags: every drill of the issue is built; an unknown one is a usage error (exit 2)."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.cli.replay import parse_drills
from kvrouter.replay import DRILLS, NOT_BUILT, ReplayError
from kvrouter.replay.stack import LocalStack, Mock, StackConfig
from tests.conftest import free_port

runner = CliRunner()


def test_every_drill_of_the_issues_is_built():
    issue = {"gap", "engine-restart", "applier-kill", "router-restart", "worker-churn", "slow-consumer",
             "nats-outage", "replica-kill", "prefill-kill"}  # fmt: skip
    assert set(DRILLS) == issue
    assert NOT_BUILT == ()
    assert "not built" not in runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "200"}).output


def test_an_unknown_drill_is_a_usage_error_listing_the_drills():
    result = runner.invoke(app, ["replay", "--drill", "gapp"])
    assert result.exit_code == 2
    assert "unknown drill" in result.output


def test_all_or_nothing_means_every_drill_built_in_the_issues_order():
    issue_order = ("gap", "engine-restart", "applier-kill", "worker-churn", "router-restart", "slow-consumer",
                   "nats-outage", "replica-kill", "prefill-kill")  # fmt: skip
    assert parse_drills(None) == parse_drills("all") == tuple(DRILLS) == issue_order
    assert parse_drills(" applier-kill, gap ,gap") == ("applier-kill", "gap")


def test_more_requests_than_the_trace_holds_is_a_usage_error():
    result = runner.invoke(app, ["replay", "--requests", "2001"])
    assert result.exit_code == 2


def test_a_router_that_stops_answering_is_a_clear_error_not_a_traceback():
    """``register`` on a port nobody listens on (a router that died after printing its URL) names the call;
    the stack's own log, where it has one, follows."""
    stack = LocalStack(StackConfig())
    stack.url = f"http://127.0.0.1:{free_port()}"  # as if started: its router printed this URL, then died

    async def register() -> None:
        try:
            await stack.register(Mock(3, "http://127.0.0.1:1"))
        finally:
            await stack.close()

    with pytest.raises(ReplayError, match=r"/register of mock engine 3: Cannot connect"):
        asyncio.run(register())


def test_an_error_escaping_the_run_exits_1_with_one_line(monkeypatch: pytest.MonkeyPatch):
    async def refused(*_: object) -> None:
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)")

    monkeypatch.setattr("kvrouter.cli.replay.run_replay", refused)
    result = runner.invoke(app, ["replay", "--drill", "gap"])
    assert result.exit_code == 1
    assert "a router or engine of the stack stopped answering: [Errno 111] Connect call failed" in result.output
    assert "Traceback" not in result.output
