"""``kvrouter up``'s replica-sync flags resolve as documented (``--print-config``, no process started)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvrouter.cli import app


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in list(os.environ):
        if name.startswith("KVROUTER_") or name == "NATS_SERVER":
            monkeypatch.delenv(name)
    return CliRunner()


def resolve(runner: CliRunner, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = runner.invoke(app, ["up", *args, "--print-config"], env=env)
    assert result.exit_code == 0, result.output
    answer: dict[str, Any] = json.loads(result.output)
    return answer


def test_defaults_are_the_references(runner: CliRunner) -> None:
    service = resolve(runner)["service"]
    assert service["replica_sync"] is False
    assert service["nats_url"] == "nats://127.0.0.1:4222"
    assert (service["namespace"], service["component"]) == ("dynamo", "backend")
    assert service["active_request_expiry_secs"] == 300.0


def test_nats_url_flag_then_kvrouter_env_then_nats_server(runner: CliRunner) -> None:
    both = {"KVROUTER_NATS_URL": "nats://a:1", "NATS_SERVER": "nats://b:2"}
    assert resolve(runner, env={"NATS_SERVER": "nats://b:2"})["service"]["nats_url"] == "nats://b:2"
    resolved = resolve(runner, env=both)
    assert resolved["service"]["nats_url"] == "nats://a:1"
    assert resolved["sources"]["nats_url"] == "env"
    assert resolve(runner, "--nats-url", "nats://c:3", env=both)["service"]["nats_url"] == "nats://c:3"


def test_sync_flags_reach_the_service_config(runner: CliRunner) -> None:
    args = ["--router-replica-sync", "--namespace", "ns-1", "--component", "router_2"]
    service = resolve(runner, *args, "--router-active-request-expiry-secs", "2.5")["service"]
    assert service["replica_sync"] is True
    assert (service["namespace"], service["component"]) == ("ns-1", "router_2")
    assert service["active_request_expiry_secs"] == 2.5


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--namespace", "a.b"], "namespace"),
        (["--component", "x y"], "component"),
        (["--router-replica-sync", "--nats-url", "http://x:1"], "nats_url"),
        (["--router-active-request-expiry-secs", "0"], "router-active-request-expiry-secs"),
    ],
)
def test_bad_values_are_refused_naming_them(runner: CliRunner, args: list[str], names: str) -> None:
    result = runner.invoke(app, ["up", *args, "--print-config"], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert names in result.output


def test_durable_flags_defaults_alias_env_and_toml(runner: CliRunner, tmp_path: Path) -> None:
    service = resolve(runner)["service"]
    assert (service["durable_kv_events"], service["reset_states"], service["router_id"]) == (False, False, None)
    assert service["snapshot_threshold"] == 1_000_000  # the reference's router_snapshot_threshold
    assert resolve(runner, "--durable-kv-events")["service"]["durable_kv_events"] is True
    env = {"KVROUTER_ROUTER_DURABLE_KV_EVENTS": "1", "KVROUTER_ROUTER_SNAPSHOT_THRESHOLD": "7"}
    resolved = resolve(runner, env={**env, "KVROUTER_ROUTER_ID": "r-1", "KVROUTER_ROUTER_RESET_STATES": "true"})
    service = resolved["service"]
    assert (service["durable_kv_events"], service["snapshot_threshold"]) == (True, 7)
    assert (service["router_id"], service["reset_states"]) == ("r-1", True)
    assert resolved["sources"]["router_snapshot_threshold"] == "env"
    toml = tmp_path / "router.toml"
    toml.write_text('router-durable-kv-events = true\nrouter_snapshot_threshold = 9\nrouter-id = "a_2"\n')
    service = resolve(runner, "--config", str(toml), "--router-snapshot-threshold", "3")["service"]
    assert (service["durable_kv_events"], service["snapshot_threshold"], service["router_id"]) == (True, 3, "a_2")


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--router-durable-kv-events", "--router-id", "a.b"], "router_id"),
        (["--router-durable-kv-events", "--nats-url", "http://x:1"], "nats_url"),
        (["--router-durable-kv-events", "--no-router-kv-events"], "durable_kv_events"),
        (["--router-snapshot-threshold", "0"], "router-snapshot-threshold"),
    ],
)
def test_bad_durable_values_are_refused_naming_them(runner: CliRunner, args: list[str], names: str) -> None:
    result = runner.invoke(app, ["up", *args, "--print-config"], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert names in result.output
