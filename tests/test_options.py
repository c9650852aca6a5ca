"""Every option of ``kvrouter up`` has one declaration (``kvrouter/options.py``), on the config field it sets.

The generated click command is walked against the declarations: each parameter's flags, variables,
default and help group come from exactly one declaration; every field of the configs ``kvrouter up``
builds is declared or listed here with the reason it is not an option; each option is read from its
flag, its variables and its TOML key (``--print-config`` naming the source); ``--help`` lists each under
its group, the groups in :class:`Panel`'s order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.core
import typer.main
from typer.testing import CliRunner

from kvrouter.chat import DEMO_MODEL
from kvrouter.cli import app
from kvrouter.cli.up import OPTIONS, ROUTER_FLAGS
from kvrouter.demo import EmbeddedConfig
from kvrouter.options import Declared, Panel, build, declared, kind, option, shared
from kvrouter.plane.config import PlaneConfig
from kvrouter.routing.config import KVROUTER_CONFIG, RouterConfig
from kvrouter.routing.disagg import DisaggConfig
from kvrouter.service.core.config import ServiceConfig

OWN = frozenset({"config", "print_config", "help"})
"""The command's own parameters: they read or show the configuration, and set no field of it."""

NOT_OPTIONS = {
    "ServiceConfig.health_interval_secs": "a test knob: how often health is refreshed",
    "ServiceConfig.decisions_ring": "the /decisions ring's length, fixed",
    "ServiceConfig.events_ring": "the /events ring's length, fixed",
    "RouterConfig.shared_cache_multiplier": "no flag: kvrouter up runs without a shared KV cache",
    "RouterConfig.shared_cache_type": "no flag: kvrouter up runs without a shared KV cache",
    "PlaneConfig.recovery_timeout": "the event plane's timers are tuned in plane/config.py",
    "PlaneConfig.restore_retry": "the event plane's timers are tuned in plane/config.py",
    "PlaneConfig.stale_after": "the event plane's timers are tuned in plane/config.py",
    "PlaneConfig.max_buffered": "a bound tuned in plane/config.py",
    "PlaneConfig.max_message_bytes": "a bound tuned in plane/config.py",
    "PlaneConfig.record_endpoint": "the service sets it from --record",
    "EmbeddedConfig.max_in_flight": "the demo client's own bound",
}
"""Fields of the configs ``kvrouter up`` builds that no option sets, each with its reason."""

NESTED = {
    "ServiceConfig.router": RouterConfig,
    "ServiceConfig.plane": PlaneConfig,
    "ServiceConfig.disagg": DisaggConfig,
}
"""Fields holding a config whose own fields declare options."""

SAMPLES: dict[str, Any] = {"shadow_policy": "round_robin", "workers": "1=tcp://127.0.0.1:5557"}
COMPANIONS: dict[str, tuple[str, str]] = {"chat_template": ("KVROUTER_TOKENIZER", "tokenizer")}
"""Options the config accepts only beside another one: (that option's variable, the option sampled for it)."""
"""A valid value for the options unset by default whose type's plain value (``FALLBACK``) the config refuses;
``decision_log``, ``record`` and ``tokenizer`` get paths under ``tmp_path``."""
FALLBACK: dict[Any, Any] = {int: 1, float: 1.0, str: "x"}
"""The value tried for an option unset by default (an env var or TOML cannot spell None), by its type."""

BY_NAME = {d.option.name: d for d in OPTIONS}


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in list(os.environ):
        if name.startswith("KVROUTER_") or name == "NATS_SERVER":
            monkeypatch.delenv(name)
    return CliRunner()


def up_command() -> typer.core.TyperCommand:
    """The command typer generates (typer carries its own copy of click: ``typer._click``)."""
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    command = group.commands["up"]
    assert isinstance(command, typer.core.TyperCommand)
    return command


def flags_of(d: Declared) -> list[str]:
    first, *aliases = d.option.flags
    negative = [f"--no-{first.removeprefix('--')}"] if d.option.negatable else []
    return [first, *aliases, *negative]


def printed_value(resolved: dict[str, Any], d: Declared) -> Any:
    value: Any = resolved["embedded" if d.owner is EmbeddedConfig else "service"]
    for name in d.path:
        value = value[name]
    return value


def sample(d: Declared, tmp_path: Path) -> Any:
    """The option's default, else a value that the configs accept (a list for a repeatable option)."""
    if d.option.name in ("decision_log", "record"):
        return str(tmp_path / f"{d.option.name}.out")
    if d.option.name in ("tokenizer", "chat_template"):
        path = tmp_path / f"{d.option.name}.file"
        path.write_text("{}")
        return str(path)
    if d.option.name == "model_path":
        return [f"m={DEMO_MODEL}", str(DEMO_MODEL)]
    if d.option.name in SAMPLES:
        return SAMPLES[d.option.name]
    if d.default is not None and not d.option.optional:
        return d.default
    value_type = d.option.value_type or next(t for t in typing.get_args(d.hint) or (d.hint,) if t is not type(None))
    return FALLBACK[value_type]


def resolve(runner: CliRunner, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = runner.invoke(app, ["up", *args, "--print-config"], env=env)
    assert result.exit_code == 0, f"{result.output}(a value refused here? give the option one in SAMPLES)"
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def test_every_parameter_comes_from_one_declaration():
    params = {p.name: p for p in up_command().params if p.name not in OWN}
    names = [d.option.name for d in OPTIONS]
    assert len(names) == len(set(names))
    assert set(params) == set(names)
    flags: list[str] = []
    envvars: list[str] = []
    for d in OPTIONS:
        param = params[d.option.name]
        assert isinstance(param, typer.core.TyperOption)
        assert [*param.opts, *param.secondary_opts] == flags_of(d), d.option.name
        given = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        assert tuple(given) == d.option.envvars, d.option.name
        assert param.default == (None if d.option.optional else d.default), d.option.name
        assert getattr(param, "rich_help_panel", None) == d.option.panel.value, d.option.name
        flags += [*param.opts, *param.secondary_opts]
        envvars += given
    own = [f for p in up_command().params if p.name in OWN for f in [*p.opts, *p.secondary_opts]]
    assert len(flags + own) == len(set(flags + own))  # no flag names two parameters
    assert len(envvars) == len(set(envvars))  # no variable feeds two parameters


def test_names_that_do_not_follow_from_the_flag_are_todays():
    assert BY_NAME["router_kv_events"].option.envvars == ("KVROUTER_ROUTER_USE_KV_EVENTS",)
    assert BY_NAME["router_kv_events"].path == ("router", "use_kv_events")
    assert BY_NAME["nats_url"].option.envvars == ("KVROUTER_NATS_URL", "NATS_SERVER")
    assert flags_of(BY_NAME["router_durable_kv_events"]) == ["--router-durable-kv-events", "--durable-kv-events"]
    assert flags_of(BY_NAME["shards"]) == ["--shards", "--router-event-threads"]
    assert flags_of(BY_NAME["router_track_active_blocks"]) == [
        "--router-track-active-blocks",
        "--no-router-track-active-blocks",
    ]
    assert BY_NAME["shadow_policy"].path == ("shadow_policies",)
    assert BY_NAME["mock_num_gpu_blocks"].path == ("num_gpu_blocks",)


def test_defaults_are_the_fields_and_router_flags_start_from_kvrouters_tuning():
    for d in OPTIONS:
        if d.owner is RouterConfig:
            assert d.default == getattr(KVROUTER_CONFIG, d.field), d.option.name
        elif d.owner is PlaneConfig:
            assert d.default == getattr(PlaneConfig(), d.field), d.option.name
        else:
            spec = next(f for f in dataclasses.fields(d.owner) if f.name == d.field)
            assert d.default == spec.default, d.option.name
    assert dict(ROUTER_FLAGS) == {  # Dynamo's flag names onto the reference's field names, as before
        "router_selection_policy": "router_selection_policy",
        "router_kv_overlap_score_credit": "overlap_score_credit",
        "router_kv_overlap_score_credit_decay": "overlap_score_credit_decay",
        "router_prefill_load_scale": "prefill_load_scale",
        "router_decode_active_request_weight": "decode_active_request_weight",
        "router_prefill_work_weight": "prefill_work_weight",
        "router_predicted_credit": "predicted_credit",
        "router_credit_load_gain": "credit_load_gain",
        "router_untrusted_overlap_weight": "untrusted_overlap_weight",
        "router_host_cache_hit_weight": "host_cache_hit_weight",
        "router_disk_cache_hit_weight": "disk_cache_hit_weight",
        "router_temperature": "router_temperature",
        "router_track_active_blocks": "router_track_active_blocks",
        "router_track_prefill_tokens": "router_track_prefill_tokens",
        "router_assume_kv_reuse": "router_assume_kv_reuse",
        "router_kv_events": "use_kv_events",
        "router_ttl_secs": "router_ttl_secs",
        "active_decode_blocks_threshold": "active_decode_blocks_threshold",
        "active_prefill_tokens_threshold": "active_prefill_tokens_threshold",
    }


def test_every_field_of_the_configs_up_builds_is_declared_or_listed():
    reachable = (ServiceConfig, RouterConfig, PlaneConfig, DisaggConfig, EmbeddedConfig)
    assert {d.owner for d in OPTIONS} == set(reachable)
    options = {f"{d.owner.__name__}.{d.field}" for d in OPTIONS}
    assert len(options) == len(OPTIONS)  # one declaration per field
    for cls in reachable:
        for spec in dataclasses.fields(cls):
            where = f"{cls.__name__}.{spec.name}"
            how = kind(spec)
            decided = [how is not None, where in NOT_OPTIONS, where in NESTED]
            assert decided.count(True) == 1, f"{where}: declare its option, or list it in NOT_OPTIONS with why"
            assert (how == "option") == (where in options), where
            if how == "shared":
                assert set(spec.metadata.values()) <= set(BY_NAME), where
    for where, nested in NESTED.items():
        name = where.removeprefix("ServiceConfig.")
        assert next(f for f in dataclasses.fields(ServiceConfig) if f.name == name).type == nested.__name__


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_each_option_is_read_from_its_flag_its_variables_and_its_toml_key(runner, tmp_path, name):
    d = BY_NAME[name]
    value = sample(d, tmp_path)
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    if d.option.multiple:  # click splits a repeatable option's variable on whitespace
        text = " ".join(value)
    companion = COMPANIONS.get(name)
    beside = {} if companion is None else {companion[0]: sample(BY_NAME[companion[1]], tmp_path)}
    expected: Any = value
    if d.option.convert is not None:
        expected = list(v) if isinstance(v := d.option.convert(value), tuple) else v
    checked = d.option.value_type is None or d.option.convert is not None

    def check(resolved: dict[str, Any], source: str) -> None:
        assert resolved["sources"][name] == source
        if d.option.secret:
            assert printed_value(resolved, d) == "<set>"
        elif checked:
            assert printed_value(resolved, d) == expected

    for variable in d.option.envvars:
        check(resolve(runner, env={**beside, variable: text}), "env")
    toml = tmp_path / "up.toml"
    toml.write_text(f"[up]\n{name} = {json.dumps(value)}\n")
    check(resolve(runner, "--config", str(toml), env=beside), "config file")
    for flag in flags_of(d):
        if isinstance(value, bool):
            resolved = resolve(runner, flag)
            assert resolved["sources"][name] == "flag"
            assert printed_value(resolved, d) is (not flag.startswith("--no-"))
        elif d.option.multiple:
            check(resolve(runner, *(arg for item in value for arg in (flag, item)), env=beside), "flag")
        else:
            check(resolve(runner, flag, text, env=beside), "flag")


def test_help_lists_each_option_under_its_group_in_declaration_order(runner):
    result = runner.invoke(app, ["up", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    shown: dict[str, list[list[str]]] = {}
    panel = ""
    for line in result.output.splitlines():
        if line.startswith("╭─ "):
            panel = line.removeprefix("╭─ ").split(" ─")[0].strip()
            shown[panel] = []
        elif line.startswith("│ -"):
            shown[panel].append(line.strip("│ ").split()[:2])
    assert list(shown) == ["Options", *(p.value for p in Panel)]
    for group in Panel:
        rows = shown[group.value] if group is not Panel.CONFIG else shown[group.value][:-2]
        listed = [d for d in OPTIONS if d.option.panel is group]
        assert [row[0] for row in rows] == [",".join(d.option.flags) for d in listed], group
        for row, d in zip(rows, listed, strict=True):
            if d.option.negatable:
                assert row[1] == f"--no-{d.option.flags[0].removeprefix('--')}"
    assert [row[0] for row in shown[Panel.CONFIG.value][-2:]] == ["--config", "--print-config"]


# -- the declaration module on its own ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Inner:
    depth: int = dataclasses.field(default=3, metadata=option("--depth", help="How deep.", panel=Panel.WORKERS))


@dataclasses.dataclass(frozen=True)
class _Outer:
    name: str = dataclasses.field(
        default="a", metadata=option("--name", help="Its name.", panel=Panel.SERVER, env=("NAME",))
    )
    inner: _Inner = _Inner(depth=5)
    also: int = 0


@dataclasses.dataclass(frozen=True)
class _Other:
    depth: int = dataclasses.field(default=1, metadata=shared("depth"))
    name: str = dataclasses.field(default="b", metadata=option("--name", help="Again.", panel=Panel.SERVER))


def test_a_nested_config_takes_its_default_from_the_outer_default_and_builds_from_values():
    (name, depth) = declared(_Outer)
    assert (name.option.envvars, name.path) == (("NAME",), ("name",))
    assert (depth.option.envvars, depth.path, depth.default) == (("KVROUTER_DEPTH",), ("inner", "depth"), 5)
    built = build(_Outer, {"name": "x", "depth": 9}, {"also": 2})
    assert built == _Outer(name="x", inner=_Inner(depth=9), also=2)


def test_a_name_declared_twice_or_a_share_of_nothing_is_refused():
    with pytest.raises(ValueError, match="'name' is declared 2 times"):
        declared(_Outer, _Other)
    with pytest.raises(ValueError, match="shares option 'depth', never declared"):
        declared(_Other)
