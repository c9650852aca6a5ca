"""``kvrouter up``: the router service, and with no workers given, a demo fleet that exercises it.

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
``block_size``. ``--workers`` (flag or env) replaces them. An unknown key is an error naming it, not a
silently ignored typo.

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
import json
import logging
import signal
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer

from ..errors import ConfigError, KvRouterError
from ..index.layout import MAX_INDEX_BLOCKS
from ..plane.config import SUBSCRIBER_HWM, PlaneConfig
from ..plane.registry import WorkerSpec, parse_workers
from ..routing.config import KVROUTER_CONFIG
from .stacks import stacks_later, stacks_on_sigusr1

if TYPE_CHECKING:
    from ..demo import Embedded, EmbeddedConfig
    from ..service.core.config import ServiceConfig
    from ..service.process.app import Service

__all__ = ["EPILOG", "ROUTER_FLAGS", "load_toml", "up"]

log = logging.getLogger(__name__)

STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each stops the service cleanly; SIGHUP too, so closing the terminal (or its tmux) does not kill it
mid-flight with its segments and demo engines left behind."""
STOP_AFTER_DRAIN_S: Final = 5.0
"""A stop still running this long after the drain (10 s after the signal, by default; the process's exit
included) has hung somewhere: every thread's stack goes to stderr (``cli/stacks.py``), and the stop
carries on."""
SLOW_START_S: Final = 5.0
"""After this long without the index up, say why: a warm start takes about 2 s, a first run on a cold
numba cache about a minute of compiling, and silence meanwhile looks like a hang."""

_SERVER: Final = "Server"
_WORKERS: Final = "Workers"
_COST: Final = "Routing cost"
_EVENTS: Final = "KV events"
_OVERLOAD: Final = "Overload"
_PROXY: Final = "Proxy and sessions (POST /v1/completions)"
_SYNC: Final = "Replica sync (NATS; docs/nats-bridge.md)"
_DEMO: Final = "Embedded demo (no --workers)"
_CONFIG: Final = "Configuration"

DEFAULT_MOCK_WORKERS: Final = 4
"""Mock engines started when no ``--workers`` are given and ``--mock-workers`` is not set."""

EPILOG: Final = (
    "Precedence: flag > KVROUTER_* environment variable > --config TOML file > default.\n\n"
    "Examples:\n\n"
    "  kvrouter up                                   # 4 mock engines and a gentle client: watch it route\n\n"
    "  kvrouter up --workers 1=tcp://10.0.0.5:5557,2:2=tcp://10.0.0.6:5557 --block-size 16 --shards 4\n\n"
    "  KVROUTER_ROUTER_TEMPERATURE=0.2 kvrouter up --config router.toml --print-config"
)

ROUTER_FLAGS: Final[Mapping[str, str]] = {
    "router_selection_policy": "router_selection_policy",
    "router_kv_overlap_score_credit": "overlap_score_credit",
    "router_kv_overlap_score_credit_decay": "overlap_score_credit_decay",
    "router_prefill_load_scale": "prefill_load_scale",
    "router_decode_active_request_weight": "decode_active_request_weight",
    "router_prefill_work_weight": "prefill_work_weight",
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
"""Option (python name) → :class:`RouterConfig` field: Dynamo's flag names onto the reference's field names."""

_TOML_WORKERS: Final = "kvrouter.toml_workers"
"""``ctx.meta`` key of the ``[[workers]]`` tables of the config file, parsed."""

_WORKER_KEYS: Final = frozenset(
    {"worker_id", "endpoint", "format", "replay_endpoint", "query_endpoint", "topic", "dp_size", "block_size"}
)

_SOURCES: Final = {"COMMANDLINE": "flag", "ENVIRONMENT": "env", "DEFAULT_MAP": "config file", "DEFAULT": "default"}


# -- the config file -------------------------------------------------------------------------------


def load_toml(path: Path, known: set[str]) -> tuple[dict[str, Any], list[WorkerSpec] | None]:
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
    workers: list[WorkerSpec] | None = None
    for key, value in table.items():
        name = key.replace("-", "_")
        if name == "workers" and isinstance(value, list):
            workers = [_toml_worker(path, i, item) for i, item in enumerate(value)]
            continue
        if name not in known:
            raise ConfigError(f"config file {str(path)!r}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        values[name] = value
    return values, workers


def _toml_worker(path: Path, index: int, item: object) -> WorkerSpec:
    where = f"config file {str(path)!r}: workers[{index}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(item) - _WORKER_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; known: {', '.join(sorted(_WORKER_KEYS))}")
    try:
        worker_id, endpoint = int(item["worker_id"]), str(item["endpoint"])
        return WorkerSpec(
            worker_id,
            endpoint,
            format=str(item.get("format", "vllm")),  # type: ignore[arg-type]  # WorkerSpec validates it
            replay_endpoint=item.get("replay_endpoint"),
            query_endpoint=item.get("query_endpoint"),
            topic=str(item.get("topic", "")).encode(),
            dp_ranks=tuple(range(int(item.get("dp_size", 1)))),
            block_size=int(item.get("block_size", 16)),
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _read_config(ctx: typer.Context, _param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Eager ``--config``: the file's values become ``ctx.default_map``, below flags and env."""
    if value is None:
        return None
    known = {p.name for p in ctx.command.params if p.name and p.name not in ("config", "print_config", "help")}
    try:
        values, workers = load_toml(value, known)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    ctx.default_map = {**(ctx.default_map or {}), **values}
    if workers is not None:
        ctx.meta[_TOML_WORKERS] = workers
    return value


# -- the command -----------------------------------------------------------------------------------


def up(
    ctx: typer.Context,
    # Server
    host: Annotated[
        str,
        typer.Option(
            "--host",
            envvar="KVROUTER_HOST",
            help="Address the API binds (a warning without --auth-token on a non-loopback one).",
            rich_help_panel=_SERVER,
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            "--port",
            envvar="KVROUTER_PORT",
            min=0,
            max=65535,
            help="API port; 0 picks a free one.",
            rich_help_panel=_SERVER,
        ),
    ] = 8490,
    zmq_port: Annotated[
        int | None,
        typer.Option(
            "--zmq-port",
            envvar="KVROUTER_ZMQ_PORT",
            min=0,
            max=65535,
            help="ZMQ fast path port (msgpack over a ROUTER socket, docs/zmq-fast-path.md); 0 turns it off.",
            show_default="--port + 1",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    auth_token: Annotated[
        str | None,
        typer.Option(
            "--auth-token",
            envvar="KVROUTER_AUTH_TOKEN",
            help="Bearer token the write routes require.",
            show_default="none",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            "--max-body-bytes",
            envvar="KVROUTER_MAX_BODY_BYTES",
            min=1024,
            help="\\[bytes] Largest request body (413 above).",
            rich_help_panel=_SERVER,
        ),
    ] = 8 << 20,
    drain_secs: Annotated[
        float,
        typer.Option(
            "--drain-secs",
            envvar="KVROUTER_DRAIN_SECS",
            min=0.0,
            max=8.0,
            help="\\[secs] How long SIGTERM waits for in-flight requests.",
            rich_help_panel=_SERVER,
        ),
    ] = 5.0,
    fronts: Annotated[
        int,
        typer.Option(
            "--fronts",
            envvar="KVROUTER_FRONTS",
            min=1,
            max=64,
            help="Front processes answering on --port together (connections dealt in turn), their loads in step.",
            rich_help_panel=_SERVER,
        ),
    ] = 1,
    # Workers
    shards: Annotated[
        int,
        typer.Option(
            "--shards",
            "--router-event-threads",
            envvar="KVROUTER_SHARDS",
            min=1,
            max=64,
            help="Applier processes owning the index (Dynamo's --router-event-threads).",
            rich_help_panel=_WORKERS,
        ),
    ] = 4,
    max_index_blocks: Annotated[
        int,
        typer.Option(
            "--max-index-blocks",
            envvar="KVROUTER_MAX_INDEX_BLOCKS",
            min=0,
            help="Cap on the index's (worker, block) entries, all workers and tiers, split evenly over the shards; "
            "past it, blocks of workers not exact go first, then the least recently stored or matched. 0: no cap. "
            "The default is about 2.2 GiB of index (4.4 at worst).",
            rich_help_panel=_WORKERS,
        ),
    ] = MAX_INDEX_BLOCKS,
    workers: Annotated[
        str | None,
        typer.Option(
            "--workers",
            envvar="KVROUTER_WORKERS",
            help="Workers in the reference indexer's syntax, "
            "id[:dp_size]=tcp://host:port, comma-separated (more through /register or \\[\\[workers]] in --config).",
            show_default="none",
            rich_help_panel=_WORKERS,
        ),
    ] = None,
    block_size: Annotated[
        int,
        typer.Option(
            "--block-size",
            envvar="KVROUTER_BLOCK_SIZE",
            min=1,
            help="\\[tokens] KV block size of --workers and the mock engines.",
            rich_help_panel=_WORKERS,
        ),
    ] = 16,
    model_name: Annotated[
        str,
        typer.Option(
            "--model-name",
            envvar="KVROUTER_MODEL_NAME",
            help="Model (partition) of --workers and the mock engines.",
            rich_help_panel=_WORKERS,
        ),
    ] = "default",
    routing_group: Annotated[
        str,
        typer.Option(
            "--routing-group",
            envvar="KVROUTER_ROUTING_GROUP",
            help="Routing group of --workers and the mock engines.",
            rich_help_panel=_WORKERS,
        ),
    ] = "default",
    # Routing cost
    router_selection_policy: Annotated[
        str,
        typer.Option(
            "--router-selection-policy",
            envvar="KVROUTER_ROUTER_SELECTION_POLICY",
            help="What is minimised: "
            "'default' (the reference's sum) or 'lmetric' (prefill x decode, kvrouter's tuned default).",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.router_selection_policy,
    router_kv_overlap_score_credit: Annotated[
        float,
        typer.Option(
            "--router-kv-overlap-score-credit",
            envvar="KVROUTER_ROUTER_KV_OVERLAP_SCORE_CREDIT",
            min=0.0,
            help="\\[blocks per cached block] Prefill credit of a device-cache hit.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.overlap_score_credit,
    router_kv_overlap_score_credit_decay: Annotated[
        float,
        typer.Option(
            "--router-kv-overlap-score-credit-decay",
            envvar="KVROUTER_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",
            min=0.0,
            help="Shrinks the credit of workers with more queued prefill than the least loaded.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.overlap_score_credit_decay,
    router_prefill_load_scale: Annotated[
        float,
        typer.Option(
            "--router-prefill-load-scale",
            envvar="KVROUTER_ROUTER_PREFILL_LOAD_SCALE",
            min=0.0,
            help="Multiplier on the uncached prefill blocks.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.prefill_load_scale,
    router_decode_active_request_weight: Annotated[
        float,
        typer.Option(
            "--router-decode-active-request-weight",
            envvar="KVROUTER_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
            min=0.0,
            help="\\[blocks per request] Decode cost of each active request.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.decode_active_request_weight,
    router_prefill_work_weight: Annotated[
        float,
        typer.Option(
            "--router-prefill-work-weight",
            envvar="KVROUTER_ROUTER_PREFILL_WORK_WEIGHT",
            min=0.0,
            help="kvrouter's term: scales a worker's cost by its share of the last minute's uncached prefill "
            "(0 = the reference's behaviour).",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.prefill_work_weight,
    router_untrusted_overlap_weight: Annotated[
        float,
        typer.Option(
            "--router-untrusted-overlap-weight",
            envvar="KVROUTER_ROUTER_UNTRUSTED_OVERLAP_WEIGHT",
            min=0.0,
            max=1.0,
            help="kvrouter's: multiplies the overlap credit of workers whose trust is not exact "
            "(partial, stale, misconfigured; docs/insight.md); 1 = off.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.untrusted_overlap_weight,
    router_host_cache_hit_weight: Annotated[
        float,
        typer.Option(
            "--router-host-cache-hit-weight",
            envvar="KVROUTER_ROUTER_HOST_CACHE_HIT_WEIGHT",
            min=0.0,
            help="\\[blocks per cached block] Credit of a host-memory hit beyond the device overlap.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.host_cache_hit_weight,
    router_disk_cache_hit_weight: Annotated[
        float,
        typer.Option(
            "--router-disk-cache-hit-weight",
            envvar="KVROUTER_ROUTER_DISK_CACHE_HIT_WEIGHT",
            min=0.0,
            help="\\[blocks per cached block] Credit of a disk hit beyond the host overlap.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.disk_cache_hit_weight,
    router_temperature: Annotated[
        float,
        typer.Option(
            "--router-temperature",
            envvar="KVROUTER_ROUTER_TEMPERATURE",
            min=0.0,
            help="0: the cheapest worker (random tie-break); above 0: softmax sampling over normalised costs.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.router_temperature,
    router_track_active_blocks: Annotated[
        bool,
        typer.Option(
            "--router-track-active-blocks/--no-router-track-active-blocks",
            envvar="KVROUTER_ROUTER_TRACK_ACTIVE_BLOCKS",
            help="Count active requests' blocks in the decode term.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.router_track_active_blocks,
    router_track_prefill_tokens: Annotated[
        bool,
        typer.Option(
            "--router-track-prefill-tokens/--no-router-track-prefill-tokens",
            envvar="KVROUTER_ROUTER_TRACK_PREFILL_TOKENS",
            help="Count queued prefill tokens in the prefill term.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.router_track_prefill_tokens,
    router_assume_kv_reuse: Annotated[
        bool,
        typer.Option(
            "--router-assume-kv-reuse/--no-router-assume-kv-reuse",
            envvar="KVROUTER_ROUTER_ASSUME_KV_REUSE",
            help="Active requests sharing a prefix share its blocks.",
            rich_help_panel=_COST,
        ),
    ] = KVROUTER_CONFIG.router_assume_kv_reuse,
    # KV events
    router_kv_events: Annotated[
        bool,
        typer.Option(
            "--router-kv-events/--no-router-kv-events",
            envvar="KVROUTER_ROUTER_USE_KV_EVENTS",
            help="Index the engines' KV events; --no-: approximate mode, the router's own decisions stand in for them.",
            rich_help_panel=_EVENTS,
        ),
    ] = KVROUTER_CONFIG.use_kv_events,
    router_ttl_secs: Annotated[
        float,
        typer.Option(
            "--router-ttl-secs",
            envvar="KVROUTER_ROUTER_TTL_SECS",
            min=0.001,
            help="\\[secs] How long a routed prefix counts as cached in approximate mode.",
            rich_help_panel=_EVENTS,
        ),
    ] = KVROUTER_CONFIG.router_ttl_secs,
    subscriber_hwm: Annotated[
        int,
        typer.Option(
            "--subscriber-hwm",
            envvar="KVROUTER_SUBSCRIBER_HWM",
            min=1,
            help="\\[messages] Events a worker's SUB queues unread before the worker's publisher must hold or drop "
            "them (a drop shows as a gap, recovered by replay or counted lost).",
            rich_help_panel=_EVENTS,
        ),
    ] = SUBSCRIBER_HWM,
    subscriber_rcvbuf: Annotated[
        int,
        typer.Option(
            "--subscriber-rcvbuf",
            envvar="KVROUTER_SUBSCRIBER_RCVBUF",
            min=0,
            help="\\[bytes] Kernel receive buffer of each SUB connection (SO_RCVBUF); 0 = the OS's default.",
            rich_help_panel=_EVENTS,
        ),
    ] = 0,
    # Overload
    active_decode_blocks_threshold: Annotated[
        float | None,
        typer.Option(
            "--active-decode-blocks-threshold",
            envvar="KVROUTER_ACTIVE_DECODE_BLOCKS_THRESHOLD",
            min=0.0,
            max=1.0,
            help="\\[fraction of KV capacity] A worker above it is busy.",
            show_default="off",
            rich_help_panel=_OVERLOAD,
        ),
    ] = None,
    active_prefill_tokens_threshold: Annotated[
        int | None,
        typer.Option(
            "--active-prefill-tokens-threshold",
            envvar="KVROUTER_ACTIVE_PREFILL_TOKENS_THRESHOLD",
            min=0,
            help="\\[tokens] A worker with more queued prefill is busy.",
            show_default="off",
            rich_help_panel=_OVERLOAD,
        ),
    ] = None,
    overload_status: Annotated[
        int,
        typer.Option(
            "--overload-status",
            envvar="KVROUTER_OVERLOAD_STATUS",
            min=400,
            max=599,
            help="HTTP status when every worker is busy (Dynamo's 529; 429 for clients that know no 529).",
            rich_help_panel=_OVERLOAD,
        ),
    ] = 529,
    router_queue_threshold: Annotated[
        int | None,
        typer.Option(
            "--router-queue-threshold",
            envvar="KVROUTER_ROUTER_QUEUE_THRESHOLD",
            min=1,
            help="\\[requests] When every worker is busy, requests wait in the partition's queue instead of "
            "getting --overload-status, at most this many (more still get it).",
            show_default="off",
            rich_help_panel=_OVERLOAD,
        ),
    ] = None,
    router_queue_policy: Annotated[
        str,
        typer.Option(
            "--router-queue-policy",
            envvar="KVROUTER_ROUTER_QUEUE_POLICY",
            help="Order of the queue: 'fcfs' (arrival) or 'wspt' (shortest prompt first).",
            rich_help_panel=_OVERLOAD,
        ),
    ] = "fcfs",
    router_queue_timeout_secs: Annotated[
        float,
        typer.Option(
            "--router-queue-timeout-secs",
            envvar="KVROUTER_ROUTER_QUEUE_TIMEOUT_SECS",
            min=0.001,
            help="\\[secs] A queued request still waiting after this gets --overload-status.",
            rich_help_panel=_OVERLOAD,
        ),
    ] = 60.0,
    # Proxy and sessions
    router_session_affinity_ttl_secs: Annotated[
        float | None,
        typer.Option(
            "--router-session-affinity-ttl-secs",
            envvar="KVROUTER_ROUTER_SESSION_AFFINITY_TTL_SECS",
            min=0.001,
            help="\\[secs] A session (header X-Dynamo-Session-ID, or session_id in /select) sticks to its first "
            "worker while that worker is schedulable, this long since its last request.",
            show_default="off",
            rich_help_panel=_PROXY,
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            envvar="KVROUTER_TOKENIZER",
            help="A local tokenizer.json: /v1/completions then also takes text prompts (else token ids only).",
            show_default="off",
            rich_help_panel=_PROXY,
        ),
    ] = None,
    shadow_policy: Annotated[
        str | None,
        typer.Option(
            "--shadow-policy",
            envvar="KVROUTER_SHADOW_POLICY",
            help="Simulator policies (comma-separated) asked on every decision and compared in /metrics, "
            "never used to route (kvrouter simulate --help lists them).",
            show_default="none",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    decision_log: Annotated[
        str | None,
        typer.Option(
            "--decision-log",
            envvar="KVROUTER_DECISION_LOG",
            help="Append every decision to FILE as a JSON line (summarise it with kvrouter decision-log FILE).",
            show_default="off",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    record: Annotated[
        str | None,
        typer.Option(
            "--record",
            metavar="FILE",
            envvar="KVROUTER_RECORD",
            help="Record the run (registrations, every event batch applied, every decision) to FILE, to replay "
            "it later with kvrouter replay --from FILE (docs/replay.md). Not with --fronts > 1 or replica sync.",
            show_default="off",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    router_seed: Annotated[
        int | None,
        typer.Option(
            "--router-seed",
            envvar="KVROUTER_ROUTER_SEED",
            help="Seed every partition's router (tie-breaks and sampling draw alike in every run); with --record "
            "the recording's header keeps it (drawn at random when not given).",
            show_default="a fresh seed per router",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    # Replica sync
    router_replica_sync: Annotated[
        bool,
        typer.Option(
            "--router-replica-sync",
            envvar="KVROUTER_ROUTER_REPLICA_SYNC",
            help="Share reservations with the other replicas over NATS: publish this router's AddRequest / "
            "MarkPrefillCompleted / Free, apply theirs; a late joiner takes a peer's snapshot.",
            rich_help_panel=_SYNC,
        ),
    ] = False,
    nats_url: Annotated[
        str,
        typer.Option(
            "--nats-url",
            envvar=["KVROUTER_NATS_URL", "NATS_SERVER"],
            help="The NATS server of the replica sync (env KVROUTER_NATS_URL, else NATS_SERVER).",
            rich_help_panel=_SYNC,
        ),
    ] = "nats://127.0.0.1:4222",
    namespace: Annotated[
        str,
        typer.Option(
            "--namespace",
            envvar="KVROUTER_NAMESPACE",
            help="Subjects are namespace.<namespace>.component.<component>.active_sequences_events.",
            rich_help_panel=_SYNC,
        ),
    ] = "dynamo",
    component: Annotated[
        str,
        typer.Option("--component", envvar="KVROUTER_COMPONENT", help="See --namespace.", rich_help_panel=_SYNC),
    ] = "backend",
    router_active_request_expiry_secs: Annotated[
        float,
        typer.Option(
            "--router-active-request-expiry-secs",
            envvar="KVROUTER_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",
            min=0.001,
            help="\\[secs] A reservation neither freed nor completed (a peer's too: a replica that died) is "
            "dropped at this age.",
            rich_help_panel=_SYNC,
        ),
    ] = 300.0,
    router_durable_kv_events: Annotated[
        bool,
        typer.Option(
            "--router-durable-kv-events",
            "--durable-kv-events",
            envvar="KVROUTER_ROUTER_DURABLE_KV_EVENTS",
            help="Workers' NATS kv-events are kept in a JetStream stream this replica reads as a durable consumer; "
            "index snapshots go to the object store; a restarted replica resumes without asking any worker.",
            rich_help_panel=_SYNC,
        ),
    ] = False,
    router_snapshot_threshold: Annotated[
        int,
        typer.Option(
            "--router-snapshot-threshold",
            envvar="KVROUTER_ROUTER_SNAPSHOT_THRESHOLD",
            min=1,
            help="\\[messages] Durable mode: past this many messages in the stream, snapshot the index and "
            "purge the stream up to it.",
            rich_help_panel=_SYNC,
        ),
    ] = 1_000_000,
    router_reset_states: Annotated[
        bool,
        typer.Option(
            "--router-reset-states",
            envvar="KVROUTER_ROUTER_RESET_STATES",
            help="Durable mode: at start, delete the snapshot bucket and purge the stream.",
            rich_help_panel=_SYNC,
        ),
    ] = False,
    router_id: Annotated[
        str | None,
        typer.Option(
            "--router-id",
            envvar="KVROUTER_ROUTER_ID",
            help="This replica's stable name (durable mode: its consumer is kvrouter-<id>, found again after a "
            "restart).",
            show_default="<hostname>-<port>",
            rich_help_panel=_SYNC,
        ),
    ] = None,
    # Embedded demo
    mock_workers: Annotated[
        int | None,
        typer.Option(
            "--mock-workers",
            envvar="KVROUTER_MOCK_WORKERS",
            min=0,
            max=64,
            help=f"Mock engines to start and route to, with a gentle client (0 = none). Default "
            f"{DEFAULT_MOCK_WORKERS} without --workers, 0 with.",
            show_default=False,
            rich_help_panel=_DEMO,
        ),
    ] = None,
    mock_num_gpu_blocks: Annotated[
        int,
        typer.Option(
            "--mock-num-gpu-blocks",
            envvar="KVROUTER_MOCK_NUM_GPU_BLOCKS",
            min=16,
            help="\\[blocks] KV capacity of each mock engine.",
            rich_help_panel=_DEMO,
        ),
    ] = 4096,
    client_rate: Annotated[
        float,
        typer.Option(
            "--client-rate",
            envvar="KVROUTER_CLIENT_RATE",
            min=0.0,
            max=1000.0,
            help="\\[requests/s] The built-in client's request rate (0 = mock engines, no client).",
            rich_help_panel=_DEMO,
        ),
    ] = 3.0,
    status_secs: Annotated[
        float,
        typer.Option(
            "--status-secs",
            envvar="KVROUTER_STATUS_SECS",
            min=0.1,
            help="\\[secs] Period of the status line.",
            rich_help_panel=_DEMO,
        ),
    ] = 5.0,
    seed: Annotated[
        int,
        typer.Option("--seed", envvar="KVROUTER_SEED", help="Seed of the synthetic workload.", rich_help_panel=_DEMO),
    ] = 0,
    # Configuration
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="KVROUTER_CONFIG_FILE",
            is_eager=True,
            callback=_read_config,
            dir_okay=False,
            help="TOML file of options (below flags and env); \\[\\[workers]] tables add replay endpoints, formats "
            "and topics.",
            show_default="none",
            rich_help_panel=_CONFIG,
        ),
    ] = None,
    print_config: Annotated[
        bool,
        typer.Option(
            "--print-config",
            help="Print the resolved configuration, each value with its source, as JSON and exit.",
            rich_help_panel=_CONFIG,
        ),
    ] = False,
) -> None:
    """Run the router service: the HTTP API, the index appliers, and with no workers a demo fleet."""
    params = dict(ctx.params)
    try:
        router = dataclasses.replace(KVROUTER_CONFIG, **{field: params[name] for name, field in ROUTER_FLAGS.items()})
        specs = _workers(ctx, workers, block_size)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    mocks = mock_workers if mock_workers is not None else (0 if specs else DEFAULT_MOCK_WORKERS)
    service_values: dict[str, Any] = {
        "host": host,
        "port": port,
        # --zmq-port 0 turns the fast path off; unset, it is port + 1 (a free port with --port 0)
        "zmq_port": None if zmq_port == 0 else zmq_port if zmq_port is not None else port + 1 if port else 0,
        "shards": shards,
        "max_index_blocks": max_index_blocks,
        "fronts": fronts,
        "block_size": block_size,
        "model_name": model_name,
        "routing_group": routing_group,
        "workers": tuple(specs),
        "router": router,
        "auth_token": auth_token,
        "overload_status": overload_status,
        "max_body_bytes": max_body_bytes,
        "drain_secs": drain_secs,
        "session_affinity_ttl_secs": router_session_affinity_ttl_secs,
        "queue_threshold": router_queue_threshold,
        "queue_policy": router_queue_policy,
        "queue_timeout_secs": router_queue_timeout_secs,
        "tokenizer": tokenizer,
        "decision_log": decision_log,
        "record": record,
        "router_seed": router_seed,
        "shadow_policies": tuple(p.strip() for p in (shadow_policy or "").split(",") if p.strip()),
        "active_request_expiry_secs": router_active_request_expiry_secs,
        "replica_sync": router_replica_sync,
        "nats_url": nats_url,
        "namespace": namespace,
        "component": component,
        "durable_kv_events": router_durable_kv_events,
        "snapshot_threshold": router_snapshot_threshold,
        "reset_states": router_reset_states,
        "router_id": router_id,
        "plane": PlaneConfig(subscriber_hwm=subscriber_hwm, subscriber_rcvbuf=subscriber_rcvbuf),
    }
    demo: dict[str, Any] = {
        "mock_workers": mocks,
        "block_size": block_size,
        "num_gpu_blocks": mock_num_gpu_blocks,
        "model_name": model_name,
        "routing_group": routing_group,
        "client_rate": client_rate,
        "status_secs": status_secs,
        "seed": seed,
        "first_worker_id": 1 + max((s.worker_id for s in specs), default=0),
    }
    from ..demo import EmbeddedConfig
    from ..service.core.config import ServiceConfig  # here: the service package imports aiohttp and the engine

    try:
        service_config = ServiceConfig(**service_values)
        demo_config = EmbeddedConfig(**demo)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if print_config:
        typer.echo(json.dumps(_resolved(ctx, service_values, demo), indent=2))
        return
    raise typer.Exit(serve(service_config, demo_config if demo_config.mock_workers > 0 else None))


def _workers(ctx: typer.Context, text: str | None, block_size: int) -> list[WorkerSpec]:
    """``--workers`` (flag or env) if given, else the config file's (string or ``[[workers]]`` tables)."""
    if text is not None:
        return parse_workers(text, block_size=block_size)
    toml: list[WorkerSpec] = ctx.meta.get(_TOML_WORKERS, [])
    return list(toml)


def _resolved(ctx: typer.Context, service: dict[str, Any], demo: dict[str, Any]) -> dict[str, Any]:
    """What ``--print-config`` prints: the service's and the demo's values, and each option's source."""
    values = dict(service)
    values["router"] = dataclasses.asdict(service["router"])
    values["plane"] = dataclasses.asdict(service["plane"])
    values["workers"] = [
        {**dataclasses.asdict(w), "topic": w.topic.decode(errors="replace"), "rank_endpoints": dict(w.rank_endpoints)}
        for w in service["workers"]
    ]
    if values["auth_token"] is not None:
        values["auth_token"] = "<set>"
    sources = {}
    for param in ctx.command.params:
        if param.name and param.name not in ("print_config", "help"):
            source = ctx.get_parameter_source(param.name)
            sources[param.name] = _SOURCES.get(source.name, source.name.lower()) if source else "default"
    if sources.get("workers") == "default" and _TOML_WORKERS in ctx.meta:
        sources["workers"] = "config file"
    return {"service": values, "embedded": demo, "sources": sources}


# -- running ---------------------------------------------------------------------------------------


def serve(config: ServiceConfig, demo: EmbeddedConfig | None) -> int:
    """Start the engine (forks), then run the loop until a signal; the process's exit status."""
    from ..demo import Embedded
    from ..service.process.app import Service

    if config.auth_token is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"kvrouter up: warning: {config.host} is not loopback and no --auth-token is set", err=True)
    service = Service(config)
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
        typer.echo(f"kvrouter up: {signal.Signals(signum).name}, stopping", err=True)
        stacks_later(config.drain_secs + STOP_AFTER_DRAIN_S)  # a stop that hangs says where before it is killed
        if embedded is not None:
            embedded.stop_client()  # first, so the drain has nothing of ours to wait for
        service.stop()

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
        if service.fastpath is not None:
            typer.echo(f"kvrouter up: ZMQ fast path at {service.fastpath.endpoint}")
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
