"""The NATS drills when the stack does not allow them: ``skipped`` with the reason, nothing started, exit 0
(``kvrouter/replay/replicas.py``, ``session.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.replay import replicas
from kvrouter.replay.replicas import ReplicaStack

runner = CliRunner()


def _skipped(out: Path) -> dict[str, str]:
    document = json.loads(out.read_text())
    assert document["baseline"] is None  # nothing was started
    return {d["drill"]: d["reason"] for d in document["drills"] if d["status"] == "skipped"}


def test_without_a_nats_server_the_nats_drills_are_skipped_saying_why(monkeypatch, tmp_path):
    monkeypatch.setattr(replicas, "nats_server_binary", lambda: None)
    assert ReplicaStack.available("nats://10.0.0.9:4222") is None
    out = tmp_path / "drills.json"
    result = runner.invoke(app, ["replay", "--drill", "nats-outage,replica-kill", "--json", str(out)])
    assert result.exit_code == 0, result.output
    reasons = _skipped(out)
    assert set(reasons) == {"nats-outage", "replica-kill"}
    assert all("no nats-server" in reason for reason in reasons.values())


def test_a_given_nats_server_is_not_taken_down(tmp_path):
    out = tmp_path / "drills.json"
    args = ["replay", "--drill", "nats-outage", "--nats-url", "nats://127.0.0.1:4222", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "takes the NATS server down" in _skipped(out)["nats-outage"]
