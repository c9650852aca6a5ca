"""``kvrouter up``'s configuration, resolved without starting anything (``--print-config``).

Precedence per option: flag > ``KVROUTER_*`` environment variable > ``--config`` TOML file > default,
checked on one option at every level and across options mixing levels; the ``--router-*`` flags land
on the right ``RouterConfig`` fields, starting from ``KVROUTER_CONFIG``; ``--help`` is grouped. ``kvrouter up``
warns once when its API is off loopback without a token (``serve`` replaced, nothing started).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.cli.up import ROUTER_FLAGS
from kvrouter.index.layout import MAX_INDEX_BLOCKS
from kvrouter.plane.config import SUBSCRIBER_HWM
from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.service.core.config import is_loopback

ENV_PREFIX = "KVROUTER_"
WIDE = {"COLUMNS": "400"}
"""Rich wraps error boxes at the terminal width; wide enough that a message stays on one line."""


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner with no ``KVROUTER_*`` variable of the calling shell leaking in."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return CliRunner()


def resolve(runner: CliRunner, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = runner.invoke(app, ["up", *args, "--print-config"], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)  # type: ignore[no-any-return]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvrouter.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_issues_and_kvrouters_tuned_router(runner):
    resolved = resolve(runner)
    service = resolved["service"]
    assert (service["host"], service["port"], service["shards"], service["block_size"]) == ("127.0.0.1", 8490, 4, 16)
    assert (service["model_name"], service["routing_group"], service["workers"]) == ("default", "default", [])
    assert service["overload_status"] == 529
    router = service["router"]
    assert router["router_selection_policy"] == KVROUTER_CONFIG.router_selection_policy == "lmetric"
    assert router["overlap_score_credit"] == KVROUTER_CONFIG.overlap_score_credit
    assert resolved["embedded"]["mock_workers"] == 4  # no --workers: the demo fleet
    assert set(resolved["sources"].values()) == {"default"}


@pytest.mark.parametrize(
    ("flag", "env", "toml", "expected", "source"),
    [
        (None, None, None, 4, "default"),
        (None, None, 3, 3, "config file"),
        (None, "5", 3, 5, "env"),
        ("7", "5", 3, 7, "flag"),
        ("7", None, None, 7, "flag"),
        (None, "5", None, 5, "env"),
    ],
)
def test_precedence_is_flag_then_env_then_file_then_default(runner, tmp_path, flag, env, toml, expected, source):
    args: list[str] = []
    environ: dict[str, str] = {}
    if flag is not None:
        args += ["--shards", flag]
    if env is not None:
        environ["KVROUTER_SHARDS"] = env
    if toml is not None:
        args += ["--config", str(write(tmp_path, f"shards = {toml}\n"))]
    resolved = resolve(runner, *args, env=environ)
    assert resolved["service"]["shards"] == expected
    assert resolved["sources"]["shards"] == source


def test_levels_mix_across_options_and_the_file_comes_from_its_env_var(runner, tmp_path):
    path = write(
        tmp_path,
        'port = 9001\nrouter-temperature = 0.25\nrouter_ttl_secs = 30\nmodel_name = "flat"\n'
        '[up]\nmodel_name = "llama"\nrouter_kv_events = false\n',
    )
    resolved = resolve(
        runner,
        "--router-event-threads",
        "2",
        "--router-kv-events",
        env={"KVROUTER_CONFIG_FILE": str(path), "KVROUTER_PORT": "9002", "KVROUTER_ROUTER_TTL_SECS": "45"},
    )
    service, sources = resolved["service"], resolved["sources"]
    assert (service["shards"], sources["shards"]) == (2, "flag")  # the Dynamo alias of --shards
    assert (service["port"], sources["port"]) == (9002, "env")
    assert (service["model_name"], sources["model_name"]) == ("llama", "config file")  # [up] wins over top level
    assert (service["router"]["router_temperature"], sources["router_temperature"]) == (0.25, "config file")
    assert (service["router"]["router_ttl_secs"], sources["router_ttl_secs"]) == (45.0, "env")
    assert (service["router"]["use_kv_events"], sources["router_kv_events"]) == (True, "flag")
    assert sources["config"] == "env"


def test_every_router_flag_sets_its_router_config_field(runner):
    args = [
        "--router-selection-policy", "default",
        "--router-kv-overlap-score-credit", "0.5",
        "--router-kv-overlap-score-credit-decay", "0.1",
        "--router-prefill-load-scale", "2",
        "--router-decode-active-request-weight", "0.3",
        "--router-prefill-work-weight", "0",
        "--router-predicted-credit", "1.5",
        "--router-credit-load-gain", "0.5",
        "--router-host-cache-hit-weight", "0.6",
        "--router-disk-cache-hit-weight", "0.2",
        "--router-temperature", "0.7",
        "--no-router-track-active-blocks",
        "--no-router-track-prefill-tokens",
        "--no-router-assume-kv-reuse",
        "--no-router-kv-events",
        "--router-ttl-secs", "60",
        "--active-decode-blocks-threshold", "0.9",
        "--active-prefill-tokens-threshold", "4096",
    ]  # fmt: skip
    router = resolve(runner, *args)["service"]["router"]
    assert router == {
        **router,
        "router_selection_policy": "default",
        "overlap_score_credit": 0.5,
        "overlap_score_credit_decay": 0.1,
        "prefill_load_scale": 2.0,
        "decode_active_request_weight": 0.3,
        "prefill_work_weight": 0.0,
        "predicted_credit": 1.5,
        "credit_load_gain": 0.5,
        "host_cache_hit_weight": 0.6,
        "disk_cache_hit_weight": 0.2,
        "router_temperature": 0.7,
        "router_track_active_blocks": False,
        "router_track_prefill_tokens": False,
        "router_assume_kv_reuse": False,
        "use_kv_events": False,
        "router_ttl_secs": 60.0,
        "active_decode_blocks_threshold": 0.9,
        "active_prefill_tokens_threshold": 4096,
    }
    assert set(ROUTER_FLAGS.values()) <= set(router)


def test_workers_parse_the_reference_syntax_and_turn_the_demo_off(runner):
    resolved = resolve(runner, "--workers", "1=tcp://127.0.0.1:5557, 2:2=tcp://127.0.0.1:5600", "--block-size", "32")
    workers = resolved["service"]["workers"]
    assert [(w["worker_id"], w["endpoint"], w["dp_ranks"], w["block_size"]) for w in workers] == [
        (1, "tcp://127.0.0.1:5557", [0], 32),
        (2, "tcp://127.0.0.1:5600", [0, 1], 32),
    ]
    assert resolved["embedded"]["mock_workers"] == 0
    both = resolve(runner, "--workers", "3=tcp://127.0.0.1:5557", "--mock-workers", "2")["embedded"]
    assert (both["mock_workers"], both["first_worker_id"]) == (2, 4)  # mock ids after the given ones
    pd = resolve(runner, "--mock-prefill-workers", "1", "--mock-decode-workers", "2")["embedded"]
    assert (pd["mock_workers"], pd["mock_prefill_workers"], pd["mock_decode_workers"]) == (0, 1, 2)
    mixed = resolve(runner, "--mock-prefill-workers", "1", "--mock-workers", "2")["embedded"]
    assert (mixed["mock_workers"], mixed["mock_prefill_workers"]) == (2, 1)  # both engines only when given


def test_config_file_workers_carry_replay_endpoints_and_the_flag_replaces_them(runner, tmp_path):
    path = write(
        tmp_path,
        '[[workers]]\nworker_id = 5\nendpoint = "tcp://127.0.0.1:5557"\nreplay_endpoint = "tcp://127.0.0.1:5558"\n'
        'dp_size = 2\n[[workers]]\nworker_id = 6\nendpoint = "tcp://127.0.0.1:5560"\nformat = "kvrouter"\n'
        'query_endpoint = "tcp://127.0.0.1:5561"\ntopic = "kv"\n',
    )
    resolved = resolve(runner, "--config", str(path))
    first, second = resolved["service"]["workers"]
    assert (first["worker_id"], first["replay_endpoint"], first["dp_ranks"]) == (5, "tcp://127.0.0.1:5558", [0, 1])
    assert (second["format"], second["query_endpoint"], second["topic"]) == ("kvrouter", "tcp://127.0.0.1:5561", "kv")
    assert resolved["sources"]["workers"] == "config file"
    replaced = resolve(runner, "--config", str(path), env={"KVROUTER_WORKERS": "9=tcp://127.0.0.1:7000"})
    assert [w["worker_id"] for w in replaced["service"]["workers"]] == [9]
    assert replaced["service"]["worker_roles"] == []


def test_config_file_workers_carry_their_role_topology_domain_and_adapters(runner, tmp_path):
    path = write(
        tmp_path,
        '[[workers]]\nworker_id = 5\nendpoint = "tcp://127.0.0.1:5557"\nrole = "prefill"\n'
        'topology_domain = "rack-a"\n[[workers]]\nworker_id = 6\nendpoint = "tcp://127.0.0.1:5560"\n'
        '[[workers]]\nworker_id = 7\nendpoint = "tcp://127.0.0.1:5570"\nrole = "decode"\n'
        'lora_adapters = ["sql", "chat", "sql"]\n',
    )
    resolved = resolve(runner, "--config", str(path))
    assert [w["worker_id"] for w in resolved["service"]["workers"]] == [5, 6, 7]
    assert resolved["service"]["worker_roles"] == [  # 6 is both in the default domain: nothing to say
        {"worker_id": 5, "role": "prefill", "topology_domain": "rack-a", "lora_adapters": []},
        {"worker_id": 7, "role": "decode", "topology_domain": None, "lora_adapters": ["chat", "sql"]},
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("shardz = 3\n", "unknown key 'shardz'"),
        ("shards = \n", "kvrouter.toml"),
        ('[[workers]]\nendpoint = "tcp://h:1"\n', "missing 'worker_id'"),
        ('[[workers]]\nworker_id = 1\nendpoint = "tcp://h:1"\nformat = "nope"\n', "unknown format"),
        ('[[workers]]\nworker_id = 1\nendpoint = "tcp://h:1"\nrole = "encode"\n', "role must be one of"),
        (
            '[[workers]]\nworker_id = 1\nendpoint = "tcp://h:1"\nlora_adapters = "sql"\n',
            "lora_adapters: expected a list",
        ),
        ('shards = "many"\n', "'--shards'"),
    ],
)
def test_a_bad_config_file_is_a_usage_error_naming_the_problem(runner, tmp_path, text, message):
    result = runner.invoke(app, ["up", "--config", str(write(tmp_path, text)), "--print-config"], env=WIDE)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--workers", "one=tcp://h:1"],
        ["--router-selection-policy", "cheapest"],
        ["--port", "70000"],
        ["--router-temperature", "-1"],
        ["--fronts", "0"],
        ["--fronts", "65"],
        ["--shadow-policy", "greedy_overlap,nope"],
        ["--decision-log", "/no/such/dir/decisions.jsonl"],
        ["--record", "/no/such/dir/run.kvr"],
        ["--record", "run.kvr", "--fronts", "2"],
        ["--record", "run.kvr", "--router-replica-sync"],
    ],
)
def test_bad_values_are_usage_errors(runner, args):
    assert runner.invoke(app, ["up", *args, "--print-config"]).exit_code == 2


def test_fronts_shadows_and_the_decision_log_come_from_flags_env_or_file(runner, tmp_path):
    log = str(tmp_path / "decisions.jsonl")
    resolved = resolve(runner, "--fronts", "3", "--shadow-policy", "greedy_overlap, dynamo_t0", "--decision-log", log)
    service = resolved["service"]
    assert (service["fronts"], service["shadow_policies"], service["decision_log"]) == (
        3,
        ["greedy_overlap", "dynamo_t0"],
        log,
    )
    env = {"KVROUTER_FRONTS": "2", "KVROUTER_SHADOW_POLICY": "round_robin"}
    service = resolve(runner, env=env)["service"]
    assert (service["fronts"], service["shadow_policies"]) == (2, ["round_robin"])
    path = write(tmp_path, 'fronts = 4\nshadow_policy = "least_loaded"\n')
    service = resolve(runner, "--config", str(path))["service"]
    assert (service["fronts"], service["shadow_policies"]) == (4, ["least_loaded"])


def test_the_recording_and_its_seed_come_from_flags_or_env(runner, tmp_path):
    path = str(tmp_path / "run.kvr")
    service = resolve(runner, "--record", path, "--router-seed", "7")["service"]
    assert (service["record"], service["router_seed"]) == (path, 7)
    service = resolve(runner, env={"KVROUTER_RECORD": path})["service"]
    assert (service["record"], service["router_seed"]) == (path, None)


def test_the_index_cap_comes_from_a_flag_env_or_file_and_is_bounded_by_default(runner, tmp_path):
    assert resolve(runner)["service"]["max_index_blocks"] == MAX_INDEX_BLOCKS > 0  # never unbounded by default
    assert resolve(runner, "--max-index-blocks", "0")["service"]["max_index_blocks"] == 0  # off, on request
    resolved = resolve(runner, env={"KVROUTER_MAX_INDEX_BLOCKS": "9000"})
    assert (resolved["service"]["max_index_blocks"], resolved["sources"]["max_index_blocks"]) == (9000, "env")
    resolved = resolve(runner, "--config", str(write(tmp_path, "max_index_blocks = 77\n")))
    assert (resolved["service"]["max_index_blocks"], resolved["sources"]["max_index_blocks"]) == (77, "config file")
    assert runner.invoke(app, ["up", "--max-index-blocks", "-1", "--print-config"]).exit_code == 2


def test_auth_token_comes_from_the_environment_and_is_not_printed(runner):
    resolved = resolve(runner, env={"KVROUTER_AUTH_TOKEN": "s3cret"})
    assert resolved["service"]["auth_token"] == "<set>"
    assert resolved["sources"]["auth_token"] == "env"


def test_help_is_grouped_with_units_env_vars_and_an_example(runner):
    result = runner.invoke(app, ["up", "--help"], env=WIDE)
    assert result.exit_code == 0
    text = result.output
    for panel in ("Server", "Workers", "Routing cost", "KV events", "Overload", "Embedded demo", "Configuration"):
        assert f" {panel}" in text, panel
    for needle in (
        "--router-event-threads",
        "--router-kv-overlap-score-credit",
        "--no-router-kv-events",
        "[secs]",
        "[tokens]",
        "[blocks]",
        "KVROUTER_SHARDS",
        "KVROUTER_AUTH_TOKEN",
        "KVROUTER_CONFIG_FILE",
        "kvrouter up --workers",
    ):
        assert needle in text, needle


def test_the_subscriber_queue_flags_set_the_event_planes_bounds(runner):
    default = resolve(runner)["service"]["plane"]
    assert (default["subscriber_hwm"], default["subscriber_rcvbuf"]) == (SUBSCRIBER_HWM, 0)
    plane = resolve(runner, "--subscriber-hwm", "8", env={"KVROUTER_SUBSCRIBER_RCVBUF": "4096"})["service"]["plane"]
    assert (plane["subscriber_hwm"], plane["subscriber_rcvbuf"]) == (8, 4096)
    assert runner.invoke(app, ["up", "--subscriber-hwm", "0", "--print-config"]).exit_code == 2


WARNING = "is not loopback and no --auth-token is set"


@pytest.mark.parametrize(
    ("host", "warnings"),
    [
        ("0.0.0.0", 1),  # every interface
        ("10.1.2.3", 1),
        ("::", 1),
        ("router.example", 1),  # a name may resolve anywhere
        ("127.0.0.2", 0),  # 127.0.0.0/8 is loopback, not only 127.0.0.1
        ("::1", 0),
        ("[::1]", 0),
        ("localhost", 0),
    ],
)
def test_up_warns_once_when_the_api_is_off_loopback_without_a_token(runner, monkeypatch, host, warnings):
    served: list[Any] = []

    def serve(config: Any, demo: Any) -> int:
        served.append(config)
        return 0

    monkeypatch.setattr("kvrouter.cli.up.serve", serve)
    result = runner.invoke(app, ["up", "--host", host])
    assert result.exit_code == 0, result.output
    assert [config.host for config in served] == [host]
    assert result.stderr.count(WARNING) == warnings
    guarded = runner.invoke(app, ["up", "--host", host], env={"KVROUTER_AUTH_TOKEN": "s3cret"})
    assert guarded.exit_code == 0, guarded.output
    assert WARNING not in guarded.stderr


FRONTS_WARNING = "usable cores: fronts beyond the cores add no throughput"


@pytest.mark.parametrize(("fronts", "warnings"), [(1, 0), (2, 0), (3, 1), (4, 1)])
def test_up_warns_once_when_there_are_more_fronts_than_usable_cores(runner, monkeypatch, fronts, warnings):
    """Two cores usable (a container's cpuset, or a small VM): a third front only waits for one."""
    monkeypatch.setattr("kvrouter.cli.up.serve", lambda config, demo: 0)
    monkeypatch.setattr("kvrouter.cli.up.os.sched_getaffinity", lambda pid: {0, 1})
    result = runner.invoke(app, ["up", "--fronts", str(fronts)])
    assert result.exit_code == 0, result.output
    assert result.stderr.count(FRONTS_WARNING) == warnings


def test_print_config_does_not_warn(runner):
    result = runner.invoke(app, ["up", "--host", "0.0.0.0", "--print-config"])
    assert result.exit_code == 0
    assert WARNING not in result.stderr


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("127.255.255.254", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("", False),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.1", False),
        ("localhost.example", False),
    ],
)
def test_is_loopback_is_the_one_idea_of_loopback(host, loopback):
    assert is_loopback(host) is loopback
