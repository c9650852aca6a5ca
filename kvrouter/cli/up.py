"""``kvrouter up``: the router service, and with no workers given, a demo fleet that exercises it.

**Options are declared once**, on the config fields they set (``kvrouter/options.py``): ``ServiceConfig``'s,
the ``RouterConfig`` fields of the ``--router-*`` flags, ``PlaneConfig``'s subscriber bounds and the demo's
``EmbeddedConfig``. This module generates the typer command from those declarations (one
``typer.Option`` per declaration, in a ``__signature__`` built of ``inspect.Parameter`` objects, typer's
documented way of taking a function's parameters) and builds the configs back from the values click
resolved. It declares only the command's own ``--config`` and ``--print-config``. A new option is a
field with ``metadata=option(...)``; nothing here changes.

**Configuration** comes from four places, the first that has a value winning: the flag, its ``KVROUTER_*``
environment variable, the TOML file of ``--config`` (env ``KVROUTER_CONFIG_FILE``), the default. click
resolves exactly this order per parameter (command line, ``envvar``, ``ctx.default_map``, default), so
the file is read by an eager ``--config`` callback into ``ctx.default_map`` before any other option is
processed; nothing else merges values, and ``--print-config`` shows each value with its source.
click's ``auto_envvar_prefix`` is not used: it derives per-subcommand names (``KVROUTER_UP_SHARDS``)
where the spec wants ``KVROUTER_SHARDS``. Routing flags keep Dynamo's ``--router-*`` spellings, with
env names mirroring ``DYN_ROUTER_*`` (``KVROUTER_ROUTER_TEMPERATURE``), and start from kvrouter's tuned
:data:`~kvrouter.routing.config.KVROUTER_CONFIG` rather than the reference's defaults; the help shows
those values.

**The TOML file** holds the options by name (``shards = 8``, ``router_temperature = 0.1``; dashes or
underscores), at the top level or in an ``[up]`` table (which wins). Workers with what the command line
cannot say (replay endpoints, formats, topics) go in ``[[workers]]`` tables: ``worker_id``, ``endpoint``
and optionally ``format``, ``replay_endpoint``, ``query_endpoint``, ``topic``, ``dp_size``,
``block_size``, ``role``, ``topology_domain``, ``lora_adapters``. ``--workers`` (flag or env) replaces
them. An unknown key is an error naming it, not a silently ignored typo.

**Process order.** :meth:`Service.start` starts the engine, which forks its fork server and appliers; it
runs before ``asyncio.run`` and before any thread, so no fork happens in a threaded process. The mock
engines are exec'd subprocesses started from inside the loop once the API listens (so ``/health``
answers while they boot), each in its own session, so a terminal's Ctrl-C reaches only this process and
the shutdown order below stays ours: stop the client, :meth:`Service.stop` (``/ready`` 503, drain,
stop the appliers, unlink the segments), then the mock engines (terminate, wait, kill after a bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import signal
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer
from rich.markup import escape

from ..chat import DEMO_MODEL
from ..demo import EmbeddedConfig
from ..errors import ConfigError, KvRouterError
from ..options import Declared, Panel, build, declared, printed
from ..plane.registry import WorkerSpec, parse_workers
from ..routing.config import RouterConfig
from ..routing.roles import DEFAULT_ROLE
from ..service.core.config import ServiceConfig, WorkerRole
from .signals import STOP_SIGNALS
from .stacks import stacks_later, stacks_on_sigusr1

if TYPE_CHECKING:
    from ..demo import Embedded
    from ..service.process.app import Service

__all__ = ["EPILOG", "OPTIONS", "ROUTER_FLAGS", "load_toml", "up"]

log = logging.getLogger(__name__)

STOP_AFTER_DRAIN_S: Final = 5.0
"""A stop still running this long after the drain (10 s after the signal, by default; the process's exit
included) has hung somewhere: every thread's stack goes to stderr (``cli/stacks.py``), and the stop
carries on."""
SLOW_START_S: Final = 5.0
"""After this long without the index up, say why: a warm start takes about 2 s, a first run on a cold
numba cache about a minute of compiling, and silence meanwhile looks like a hang."""

EPILOG: Final = (
    "Precedence: flag > KVROUTER_* environment variable > --config TOML file > default.\n\n"
    "Examples:\n\n"
    "  kvrouter up                                   # 4 mock engines and a gentle client: watch it route\n\n"
    "  kvrouter up --workers 1=tcp://10.0.0.5:5557,2:2=tcp://10.0.0.6:5557 --block-size 16 --shards 4\n\n"
    "  KVROUTER_ROUTER_TEMPERATURE=0.2 kvrouter up --config router.toml --print-config"
)

OPTIONS: Final[tuple[Declared, ...]] = declared(ServiceConfig, EmbeddedConfig)
"""Every option of ``kvrouter up`` but ``--config`` and ``--print-config``: the configs' declarations."""

ROUTER_FLAGS: Final[Mapping[str, str]] = {d.option.name: d.field for d in OPTIONS if d.owner is RouterConfig}
"""Option (python name) → :class:`RouterConfig` field: Dynamo's flag names onto the reference's field names
(``kvrouter replay --router`` takes either)."""

_TOML_WORKERS: Final = "kvrouter.toml_workers"
"""``ctx.meta`` key of the ``[[workers]]`` tables of the config file, parsed."""

_WORKER_KEYS: Final = frozenset(
    {
        "worker_id",
        "endpoint",
        "format",
        "replay_endpoint",
        "query_endpoint",
        "topic",
        "dp_size",
        "block_size",
        "role",
        "topology_domain",
        "lora_adapters",
    }
)

_SOURCES: Final = {"COMMANDLINE": "flag", "ENVIRONMENT": "env", "DEFAULT_MAP": "config file", "DEFAULT": "default"}


# -- the config file -------------------------------------------------------------------------------


def load_toml(path: Path, known: set[str]) -> tuple[dict[str, Any], list[tuple[WorkerSpec, WorkerRole]] | None]:
    """Options and ``[[workers]]`` of a config file (see the module docstring).

    Args:
        path: the TOML file.
        known: the option names (python spelling) a key may name.

    Returns:
        (option name → value, for ``ctx.default_map``; the file's workers or None when it has none).

    Raises:
        ConfigError: the file cannot be read or parsed, a key no option has, or a bad worker table.
    """
    try:
        with path.open("rb") as fh:
            document = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc}") from exc
    table = {k: v for k, v in document.items() if k != "up"}
    section = document.get("up", {})
    if not isinstance(section, dict):
        raise ConfigError(f"config file {str(path)!r}: [up] must be a table")
    table.update(section)
    values: dict[str, Any] = {}
    workers: list[tuple[WorkerSpec, WorkerRole]] | None = None
    for key, value in table.items():
        name = key.replace("-", "_")
        if name == "workers" and isinstance(value, list):
            workers = [_toml_worker(path, i, item) for i, item in enumerate(value)]
            continue
        if name not in known:
            raise ConfigError(f"config file {str(path)!r}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        values[name] = value
    return values, workers


def _toml_worker(path: Path, index: int, item: object) -> tuple[WorkerSpec, WorkerRole]:
    where = f"config file {str(path)!r}: workers[{index}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(item) - _WORKER_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; known: {', '.join(sorted(_WORKER_KEYS))}")
    try:
        worker_id, endpoint = int(item["worker_id"]), str(item["endpoint"])
        spec = WorkerSpec(
            worker_id,
            endpoint,
            format=str(item.get("format", "vllm")),  # type: ignore[arg-type]  # WorkerSpec validates it
            replay_endpoint=item.get("replay_endpoint"),
            query_endpoint=item.get("query_endpoint"),
            topic=str(item.get("topic", "")).encode(),
            dp_ranks=tuple(range(int(item.get("dp_size", 1)))),
            block_size=int(item.get("block_size", 16)),
        )
        domain = item.get("topology_domain")
        role = WorkerRole(
            worker_id,
            str(item.get("role", DEFAULT_ROLE)),  # type: ignore[arg-type]  # WorkerRole validates it
            None if domain is None else str(domain),
            item.get("lora_adapters", ()),
        )
        return spec, role
    except KeyError as exc:
        raise ConfigError(f"{where}: missing {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _read_config(ctx: typer.Context, _param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Eager ``--config``: the file's values become ``ctx.default_map``, below flags and env."""
    if value is None:
        return None
    try:
        values, workers = load_toml(value, {d.option.name for d in OPTIONS})
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    ctx.default_map = {**(ctx.default_map or {}), **values}
    if workers is not None:
        ctx.meta[_TOML_WORKERS] = workers
    return value


# -- the command -----------------------------------------------------------------------------------


def up(ctx: typer.Context, **values: Any) -> None:
    """Run the router service: the HTTP API, the index appliers, and with no workers a demo fleet."""
    try:
        specs, roles = _workers(ctx, values["workers"], values["block_size"])
        service_config = build(ServiceConfig, values, {"workers": tuple(specs), "worker_roles": tuple(roles)})
        demo: dict[str, Any] = {"first_worker_id": 1 + max((s.worker_id for s in specs), default=0)}
        disaggregated = values["mock_prefill_workers"] or values["mock_decode_workers"]
        if values["mock_workers"] is None and (specs or disaggregated):
            demo["mock_workers"] = 0  # given workers, or a disaggregated demo: no role-both engine unless asked
        demo_config = build(EmbeddedConfig, values, demo)
        if demo_config.roles and service_config.model_name not in dict(service_config.chat_models()):
            # the demo's engines chat with the shipped model: the router renders with the same files
            served = (*service_config.model_paths, f"{service_config.model_name}={DEMO_MODEL}")
            service_config = dataclasses.replace(service_config, model_paths=served)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if values["print_config"]:
        typer.echo(json.dumps(_resolved(ctx, service_config, demo_config), indent=2))
        return
    if service_config.exposed_without_auth:
        typer.echo(f"kvrouter up: warning: {service_config.host} is not loopback and no --auth-token is set", err=True)
    cores = len(os.sched_getaffinity(0))
    if service_config.fronts > cores:  # each front past the cores waits for one: no throughput, more CPU a request
        typer.echo(
            f"kvrouter up: warning: --fronts {service_config.fronts} on {cores} usable cores: fronts beyond the "
            'cores add no throughput and cost each request more CPU (docs/http-api.md, "Several fronts")',
            err=True,
        )
    raise typer.Exit(serve(service_config, demo_config if demo_config.roles else None))


def _parameter(option: Declared) -> inspect.Parameter:
    """The typer parameter of one declaration: its flags, variables, help, bounds and panel, its default
    the field's (None for an ``optional`` one)."""
    declaration = option.option
    value_type = declaration.value_type or _value_type(option.hint, option)
    default = None if declaration.optional else option.default
    envvars = declaration.envvars
    info = typer.Option(
        *declaration.declarations,
        envvar=envvars[0] if len(envvars) == 1 else list(envvars),
        help=escape(declaration.help),
        min=declaration.min,
        max=declaration.max,
        metavar=declaration.metavar,
        show_default=declaration.show_default,
        rich_help_panel=declaration.panel.value,
    )
    if declaration.multiple:
        value_type = list[value_type]  # type: ignore[valid-type]
    annotation = value_type if default is not None else value_type | None
    return inspect.Parameter(
        declaration.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, info]
    )


def _value_type(hint: Any, option: Declared) -> type:
    """The option's type from its field's: ``X | None`` → ``X``; a ``Literal`` of strings → ``str``."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    base = [arg for arg in args if arg is not type(None)]
    if len(base) == 1 and typing.get_origin(base[0]) is typing.Literal:
        return type(typing.get_args(base[0])[0])
    if len(base) == 1 and base[0] in (bool, int, float, str):
        return typing.cast(type, base[0])
    raise TypeError(
        f"{option.owner.__name__}.{option.field}: option {option.option.flags[0]} needs value_type "
        f"(and convert) for a field of type {hint}"
    )


_OWN_PARAMETERS: Final = (
    inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            Path | None,
            typer.Option(
                "--config",
                envvar="KVROUTER_CONFIG_FILE",
                is_eager=True,
                callback=_read_config,
                dir_okay=False,
                help=escape(
                    "TOML file of options (below flags and env); [[workers]] tables add replay endpoints, formats "
                    "and topics."
                ),
                show_default="none",
                rich_help_panel=Panel.CONFIG.value,
            ),
        ],
    ),
    inspect.Parameter(
        "print_config",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[
            bool,
            typer.Option(
                "--print-config",
                help="Print the resolved configuration, each value with its source, as JSON and exit.",
                rich_help_panel=Panel.CONFIG.value,
            ),
        ],
    ),
)
"""The command's own options: they read and show the configuration rather than set a field of it."""

up.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # what typer reads the parameters from
    [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        *(_parameter(d) for d in sorted(OPTIONS, key=lambda d: list(Panel).index(d.option.panel))),
        *_OWN_PARAMETERS,
    ]
)


def _workers(ctx: typer.Context, text: str | None, block_size: int) -> tuple[list[WorkerSpec], list[WorkerRole]]:
    """``--workers`` (flag or env) if given, else the config file's (string or ``[[workers]]`` tables); and
    the roles of those tables that are not ``both`` in the default domain."""
    if text is not None:
        return parse_workers(text, block_size=block_size), []
    toml: list[tuple[WorkerSpec, WorkerRole]] = ctx.meta.get(_TOML_WORKERS, [])
    roles = [role for _, role in toml if role != WorkerRole(role.worker_id)]
    return [spec for spec, _ in toml], roles


def _resolved(ctx: typer.Context, service: ServiceConfig, demo: EmbeddedConfig) -> dict[str, Any]:
    """What ``--print-config`` prints: the service's and the demo's values, and each option's source."""
    sources = {}
    for param in ctx.command.params:
        if param.name and param.name not in ("print_config", "help"):
            source = ctx.get_parameter_source(param.name)
            sources[param.name] = _SOURCES.get(source.name, source.name.lower()) if source else "default"
    if sources.get("workers") == "default" and _TOML_WORKERS in ctx.meta:
        sources["workers"] = "config file"
    return {"service": _json(printed(service)), "embedded": _json(printed(demo)), "sources": sources}


def _json(value: Any) -> Any:
    """A config's value as JSON takes it: a nested config as its fields, a worker's topic as text."""
    if isinstance(value, WorkerSpec):
        return {
            **dataclasses.asdict(value),
            "topic": value.topic.decode(errors="replace"),
            "rank_endpoints": dict(value.rank_endpoints),
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: _json(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_json(item) for item in value]
    return value


# -- running ---------------------------------------------------------------------------------------


def serve(config: ServiceConfig, demo: EmbeddedConfig | None) -> int:
    """Start the engine (forks), then run the loop until a signal; the process's exit status."""
    from ..demo import Embedded
    from ..service.process.app import Service
    from . import front

    service = Service(config, front_main=front.run)
    try:
        service.start()  # forks the engine's fork server: before the loop and before any thread
    except KvRouterError as exc:
        typer.echo(f"kvrouter up: the engine did not start: {exc}", err=True)
        with contextlib.suppress(Exception):
            service.engine.close()
        return 1
    embedded = None if demo is None else Embedded(demo, decisions=lambda: service.core.counters.decisions)
    try:
        with stacks_on_sigusr1():
            return asyncio.run(_run(service, config, embedded))
    except KvRouterError as exc:  # the appliers did not come up; the service closed what it opened
        typer.echo(f"kvrouter up: the engine did not start: {exc}", err=True)
        return 1


async def _run(service: Service, config: ServiceConfig, embedded: Embedded | None) -> int:
    """Serve until SIGINT/SIGTERM; the demo starts once the API listens and stops around the service."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            return
        stopping.set()
        if embedded is not None:
            embedded.stop_client()  # first, so the drain has nothing of ours to wait for
        service.stop()  # before any write: stopping never depends on stdout or stderr (kvrouter/stdio.py)
        stacks_later(config.drain_secs + STOP_AFTER_DRAIN_S)  # a stop that hangs says where before it is killed
        typer.echo(f"kvrouter up: {signal.Signals(signum).name}, stopping", err=True)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)

    started: asyncio.Task[None] | None = None
    failed = False

    def on_slow_start() -> None:
        if not stopping.is_set():
            typer.echo(
                "kvrouter up: still starting: the first run compiles its kernels into numba's cache "
                "(about a minute on 2 cores; later starts take seconds). /health answers meanwhile."
            )
            sys.stdout.flush()

    slow_start: asyncio.TimerHandle | None = None

    def on_listening(url: str) -> None:
        nonlocal slow_start
        typer.echo(f"kvrouter up: API at {url}", err=False)
        sys.stdout.flush()
        slow_start = loop.call_later(SLOW_START_S, on_slow_start)

    def on_ready(url: str) -> None:
        nonlocal started
        if slow_start is not None:
            slow_start.cancel()
        typer.echo("kvrouter up: the index is up", err=False)
        if service.fastpath_endpoint is not None:
            typer.echo(f"kvrouter up: ZMQ fast path at {service.fastpath_endpoint}")
        sys.stdout.flush()
        if embedded is not None:
            started = loop.create_task(embedded.start(url))
            started.add_done_callback(on_started)
        else:
            typer.echo(_banner_without_demo(url, config))

    def on_started(task: asyncio.Task[None]) -> None:
        nonlocal failed
        if task.cancelled() or task.exception() is None:
            return
        failed = True
        typer.echo(f"kvrouter up: the demo fleet did not start: {task.exception()}", err=True)
        on_signal(signal.SIGTERM)

    try:
        await service.run(on_ready=on_ready, on_listening=on_listening)
    finally:
        if slow_start is not None:
            slow_start.cancel()
        if started is not None and not started.done():
            started.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await started
        if embedded is not None:
            await embedded.close()  # the client (if still running), then the mock engines
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    return 1 if failed else 0


def _banner_without_demo(url: str, config: ServiceConfig) -> str:
    workers = ", ".join(str(w.worker_id) for w in config.workers) or "none yet (POST /register)"
    return (
        f"kvrouter up: model {config.model_name!r}, workers {workers}, {config.shards} shards\n"
        f"  curl -s {url}/health\n"
        f"  curl -s {url}/workers\n"
        f"  curl -s {url}/metrics\n"
        "  kvrouter top   # in another terminal: the live dashboard\n"
        "Ctrl-C stops it."
    )
