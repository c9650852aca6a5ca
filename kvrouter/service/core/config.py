"""``ServiceConfig``: everything ``kvrouter up`` hands the service, immutable and validated once.

The service reads no flags or environment itself: the ``up`` command resolves flags, ``KVROUTER_*``
variables and the TOML file into this one object (``spec/interfaces.md`` §5), so tests build a service
from a literal and the precedence rules live in one place. Each field ``kvrouter up`` sets declares its
option in its ``metadata`` (``kvrouter/options.py``): flag, variables, TOML key, help and group, with the
field's default as the option's; ``--router-*`` options are declared on ``RouterConfig``'s fields the same way.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Final, Literal

from ...bridge.subjects import Subjects
from ...errors import ConfigError
from ...index.layout import MAX_INDEX_BLOCKS
from ...options import Panel, derived, option
from ...plane.config import PlaneConfig
from ...plane.registry import WorkerSpec
from ...routing.config import KVROUTER_CONFIG, RouterConfig
from ...routing.disagg import DisaggConfig
from ...routing.roles import DEFAULT_ROLE, ROLES, Role
from ...routing.slots import DEFAULT_EXPIRY_SECS
from ...sim.policies import POLICIES
from .requests import adapter_names

__all__ = [
    "DEFAULT_NATS_URL",
    "DEFAULT_SNAPSHOT_THRESHOLD",
    "MAX_FRONTS",
    "MAX_SHARDS",
    "ZMQ_PORT_DEFAULT",
    "ServiceConfig",
    "is_loopback",
]

DEFAULT_NATS_URL: Final = "nats://127.0.0.1:4222"
"""NATS's default client port on this machine."""
MAX_FRONTS: Final = 64
"""More front processes than this would be more than any machine's cores."""
MAX_SHARDS: Final = 64
"""``kvrouter up --shards``'s bound: more appliers than cores only add context switches."""
DEFAULT_SNAPSHOT_THRESHOLD: Final = 1_000_000
"""Stream messages past which a durable replica snapshots the index: the reference's
``router_snapshot_threshold`` (``spec/dynamo-semantics.md`` §6.4)."""
_ROUTER_ID: Final = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
ZMQ_PORT_DEFAULT: Final = -1
"""``ServiceConfig.zmq_port``'s default: ``port + 1`` (a free port when ``port`` is 0)."""


def is_loopback(host: str) -> bool:
    """Whether an API bound to ``host`` is reachable from this machine only: ``localhost`` or a loopback
    address (all of 127.0.0.0/8, ``::1``, an IPv4-mapped one; IPv6 in brackets or not). ``""`` and
    ``0.0.0.0`` bind every interface, and a host name other than ``localhost`` may resolve anywhere: not
    loopback. The one test of it (``kvrouter up``'s warning, ``ServiceConfig.exposed_without_auth``).
    """
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def _names(text: str) -> tuple[str, ...]:
    """``"a, b"`` → ``("a", "b")``: a comma-separated option."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _zmq_port(port: int) -> int | None:
    """``--zmq-port 0`` turns the fast path off (``zmq_port=None``); unset, the field's default applies."""
    return None if port == 0 else port


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """A configured worker's role, topology domain and LoRA adapters (``[[workers]]``'s ``role``,
    ``topology_domain`` and ``lora_adapters``): what ``/register`` takes beside the event plane's
    :class:`WorkerSpec`, which follows events only.

    Raises:
        ConfigError: an unknown role, a domain that is not 1..256 characters, or bad adapter names.
    """

    worker_id: int
    role: Role = DEFAULT_ROLE
    topology_domain: str | None = None
    lora_adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker {self.worker_id}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.topology_domain is not None and not 1 <= len(self.topology_domain) <= 256:
            raise ConfigError(f"worker {self.worker_id}: topology_domain must be 1..256 characters")
        try:
            adapters = adapter_names(self.lora_adapters)
        except ValueError as exc:
            raise ConfigError(f"worker {self.worker_id}: lora_adapters: {exc}") from exc
        object.__setattr__(self, "lora_adapters", adapters)  # sorted, as a registration holds them


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """How the service binds, which workers it starts with, how it routes and protects itself.

    A field's ``metadata`` declares the ``kvrouter up`` option that sets it (``kvrouter/options.py``);
    fields without one are not options (tests set them).

    Raises:
        ConfigError: a port (or zmq_port) outside 0..65535, shards below 1, a negative max_index_blocks, fronts
            outside 1..64, a block size below 1, an overload status that is not 429 or 5xx, a body limit below 1 KiB,
            a negative drain time, a session affinity TTL not above 0, a tokenizer path that names no file, a
            decision log in no directory, a shadow policy the simulator does not have, a queue threshold below 1, a
            queue policy other than fcfs / wspt, a queue timeout or a request expiry not above 0, a namespace or
            component that is not one NATS subject token, (with replica_sync or durable_kv_events) a nats_url that
            is not nats:// or tls://, durable_kv_events without KV events, a snapshot threshold below 1, a
            router_id that is not 1-64 letters, digits, ``_`` or ``-``, or a record file in no directory or with
            fronts > 1 or replica_sync.
    """

    # -- Server
    host: str = field(
        default="127.0.0.1",
        metadata=option(
            "--host",
            help="Address the API binds (a warning without --auth-token on a non-loopback one).",
            panel=Panel.SERVER,
        ),
    )
    port: int = field(
        default=8490,
        metadata=option("--port", help="API port; 0 picks a free one.", panel=Panel.SERVER, min=0, max=65535),
    )
    """0 picks a free port (tests); ``Service.url`` tells which."""
    zmq_port: int | None = field(
        default=ZMQ_PORT_DEFAULT,
        metadata=option(
            "--zmq-port",
            help="ZMQ fast path port (msgpack over a ROUTER socket, docs/zmq-fast-path.md); 0 turns it off.",
            panel=Panel.SERVER,
            min=0,
            max=65535,
            show_default="--port + 1",
            optional=True,
            convert=_zmq_port,
        ),
    )
    """The ZMQ fast path's port (``fastpath.py``): None turns it off, 0 picks a free port; by default
    ``port + 1``, or a free port when ``port`` is 0. Resolved in ``__post_init__``: never -1 after."""
    auth_token: str | None = field(
        default=None,
        metadata=option(
            "--auth-token",
            help="Bearer token the write routes require.",
            panel=Panel.SERVER,
            show_default="none",
            secret=True,
        ),
    )
    """Bearer token the write routes require; None leaves them open (and warns off loopback)."""
    max_body_bytes: int = field(
        default=8 << 20,
        metadata=option(
            "--max-body-bytes", help="[bytes] Largest request body (413 above).", panel=Panel.SERVER, min=1024
        ),
    )
    """Request bodies above this are refused with 413 (the reference indexer's 8 MiB)."""
    drain_secs: float = field(
        default=5.0,
        metadata=option(
            "--drain-secs",
            help="[secs] How long SIGTERM waits for in-flight requests.",
            panel=Panel.SERVER,
            min=0.0,
            max=8.0,
        ),
    )
    """On stop, how long in-flight requests are given to finish before the sockets close."""
    fronts: int = field(
        default=1,
        metadata=option(
            "--fronts",
            help="Front processes answering on --port together (two share each connection), their loads in step.",
            panel=Panel.SERVER,
            min=1,
            max=MAX_FRONTS,
        ),
    )
    """Front processes serving ``port`` together (front 0 accepts each connection and hands it to the two
    fronts that share it, ``sharing.py``), each reading the index through shared memory, their load views
    kept in step by the replica sync (``fronts.py``)."""
    shadow_policies: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "--shadow-policy",
            help="Simulator policies (comma-separated) asked on every decision and compared in /metrics, "
            "never used to route (kvrouter simulate --help lists them).",
            panel=Panel.SERVER,
            show_default="none",
            optional=True,
            value_type=str,
            convert=_names,
        ),
    )
    """Simulator policies asked on every decision, for comparison only (``shadow.py``)."""
    decision_log: str | None = field(
        default=None,
        metadata=option(
            "--decision-log",
            help="Append every decision to FILE as a JSON line (summarise it with kvrouter decision-log FILE).",
            panel=Panel.SERVER,
            show_default="off",
        ),
    )
    """Every decision appended to this file as a JSON line (``decisions.py``)."""
    record: str | None = field(
        default=None,
        metadata=option(
            "--record",
            help="Record the run (registrations, every event batch applied, every decision) to FILE, to replay "
            "it later with kvrouter replay --from FILE (docs/replay.md). Not with --fronts > 1 or replica sync.",
            panel=Panel.SERVER,
            metavar="FILE",
            show_default="off",
        ),
    )
    """The run's events, registrations and decisions written to this file for ``kvrouter replay --from``
    (``recording.py``)."""
    router_seed: int | None = field(
        default=None,
        metadata=option(
            "--router-seed",
            help="Seed every partition's router (tie-breaks and sampling draw alike in every run); with --record "
            "the recording's header keeps it (drawn at random when not given).",
            panel=Panel.SERVER,
            show_default="a fresh seed per router",
        ),
    )
    """Every partition's router seed (with ``record``, written in the header); None: a fresh seed per router
    (drawn once for the header when recording)."""

    # -- Workers
    shards: int = field(
        default=4,
        metadata=option(
            "--shards",
            "--router-event-threads",
            help="Applier processes owning the index (Dynamo's --router-event-threads).",
            panel=Panel.WORKERS,
            min=1,
            max=MAX_SHARDS,
        ),
    )
    """Applier processes of the one engine every partition shares."""
    max_index_blocks: int = field(
        default=MAX_INDEX_BLOCKS,
        metadata=option(
            "--max-index-blocks",
            help="Cap on the index's (worker, block) entries, all workers and tiers, split evenly over the shards; "
            "past it, blocks of workers not exact go first, then the least recently stored or matched. 0: no cap. "
            "The default is about 1.3 GiB of index (1.9 just after the tables double).",
            panel=Panel.WORKERS,
            min=0,
        ),
    )
    """The index cap in (worker, block) entries over every shard and tier, each shard keeping
    ``max_index_blocks // shards`` (``index/writer.py``); 0: no cap."""
    workers: tuple[WorkerSpec, ...] = field(
        default=(),
        metadata=option(
            "--workers",
            help="Workers in the reference indexer's syntax, id[:dp_size]=tcp://host:port, comma-separated "
            "(more through /register or [[workers]] in --config).",
            panel=Panel.WORKERS,
            show_default="none",
            optional=True,
            value_type=str,
        ),
    )
    """Registered in (``model_name``, ``routing_group``) when ``run`` starts. ``kvrouter up`` parses the
    option (with ``--block-size``) or the ``[[workers]]`` tables of its config file into these."""
    worker_roles: tuple[WorkerRole, ...] = field(
        default=(),
        metadata=derived("the role, topology_domain and lora_adapters keys of --config's [[workers]] tables"),
    )
    """The roles of ``workers`` that are not ``both``, or name a topology domain or adapters."""
    block_size: int = field(
        default=16,
        metadata=option(
            "--block-size",
            help="[tokens] KV block size of --workers and the mock engines.",
            panel=Panel.WORKERS,
            min=1,
        ),
    )
    """Block size of the partition of the workers given on the command line."""
    model_name: str = field(
        default="default",
        metadata=option(
            "--model-name", help="Model (partition) of --workers and the mock engines.", panel=Panel.WORKERS
        ),
    )
    routing_group: str = field(
        default="default",
        metadata=option(
            "--routing-group", help="Routing group of --workers and the mock engines.", panel=Panel.WORKERS
        ),
    )

    # -- Routing cost, KV events (the router's and the event plane's own options), Overload
    router: RouterConfig = KVROUTER_CONFIG
    """Weights and switches of every partition's router; ``use_kv_events=False`` is approximate mode. Its
    options (``--router-*``) are declared on ``RouterConfig`` and start from this default."""
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    """The event plane's timers (``stale_after``, recovery timeout) for every registered worker."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    """Disaggregated partitions' link and split rule (``routing/disagg.py``); its options are declared there."""
    overload_status: int = field(
        default=529,
        metadata=option(
            "--overload-status",
            help="HTTP status when every worker is busy (Dynamo's 529; 429 for clients that know no 529).",
            panel=Panel.OVERLOAD,
            min=400,
            max=599,
        ),
    )
    """Status when every candidate is over a busy threshold (529 as the reference; 429 for clients
    that cannot handle 529)."""
    queue_threshold: int | None = field(
        default=None,
        metadata=option(
            "--router-queue-threshold",
            help="[requests] When every worker is busy, requests wait in the partition's queue instead of "
            "getting --overload-status, at most this many (more still get it).",
            panel=Panel.OVERLOAD,
            min=1,
            show_default="off",
        ),
    )
    """Requests that find every worker of their partition busy wait in the partition's queue (``queue.py``),
    at most this many; None refuses them at once (``overload_status``)."""
    queue_policy: Literal["fcfs", "wspt"] = field(
        default="fcfs",
        metadata=option(
            "--router-queue-policy",
            help="Order of the queue: 'fcfs' (arrival) or 'wspt' (shortest prompt first).",
            panel=Panel.OVERLOAD,
        ),
    )
    """The queue's order, arrival (``fcfs``) or shortest prompt (``wspt``)."""
    queue_timeout_secs: float = field(
        default=60.0,
        metadata=option(
            "--router-queue-timeout-secs",
            help="[secs] A queued request still waiting after this gets --overload-status.",
            panel=Panel.OVERLOAD,
            min=0.001,
        ),
    )
    """How long a request waits in the queue before it is refused with ``overload_status``."""
    queue_priority_age_secs: float | None = field(
        default=10.0,
        metadata=option(
            "--router-queue-priority-age-secs",
            help="[secs] A queued request's priority class improves by one per this long waited, so a low "
            "class is never starved (priority: the body's field or X-Kvrouter-Priority; lower first).",
            panel=Panel.OVERLOAD,
            min=0.001,
        ),
    )
    """The router queue's ageing interval (``queue.py``): a waiting request moves up one priority class per
    interval; None: classes never age."""

    # -- Proxy and sessions
    session_affinity_ttl_secs: float | None = field(
        default=None,
        metadata=option(
            "--router-session-affinity-ttl-secs",
            help="[secs] A session (header X-Dynamo-Session-ID, or session_id in /select) sticks to its first "
            "worker while that worker is schedulable, this long since its last request.",
            panel=Panel.PROXY,
            min=0.001,
            show_default="off",
        ),
    )
    """A session (``X-Dynamo-Session-ID``, ``session_id``) sticks to its first worker for this long since its
    last request; None turns affinity off."""
    tokenizer: str | None = field(
        default=None,
        metadata=option(
            "--tokenizer",
            help="A local tokenizer.json: /v1/completions then also takes text prompts (else token ids only).",
            panel=Panel.PROXY,
            show_default="off",
        ),
    )
    """A local ``tokenizer.json`` for text prompts of ``/v1/completions``; None takes token-id prompts only."""
    chat_template: str | None = field(
        default=None,
        metadata=option(
            "--chat-template",
            help="A Jinja2 chat template file: with --tokenizer, /v1/chat/completions serves --model-name "
            "(a --model-path directory has both).",
            panel=Panel.PROXY,
            show_default="off",
        ),
    )
    """With ``tokenizer``: the default model's chat template (``kvrouter/chat/model.py``)."""
    otlp_endpoint: str | None = field(
        default=None,
        metadata=option(
            "--otlp-endpoint",
            help="An OpenTelemetry collector's base URL: a span per proxied request (queue wait, decision, "
            "upstream call) POSTed to URL/v1/traces as OTLP/HTTP protobuf; a client's traceparent is continued.",
            panel=Panel.PROXY,
            show_default="off",
        ),
    )
    """Where the proxy's spans go (``edges/tracing.py``); None: no tracing, nothing imported."""
    forward_tokens: bool = field(
        default=False,
        metadata=option(
            "--forward-tokens",
            help="Send a chat's rendered token ids to the engine's /v1/completions (and turn its answer back "
            "into chat objects) instead of forwarding the chat unchanged to /v1/chat/completions.",
            panel=Panel.PROXY,
        ),
    )
    """``/v1/chat/completions`` sends the router's tokens to the engine's ``/v1/completions``
    (``edges/chat_answer.py`` turns the answer back), so the engine prefills exactly what was routed."""
    model_paths: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "--model-path",
            help="[NAME=]DIR: a local model directory as Hugging Face lays it out (tokenizer.json, "
            "tokenizer_config.json's chat template, config.json): /v1/chat/completions renders and tokenizes "
            "model NAME's chats with it (DIR alone: --model-name). Repeatable, one per model; never downloads.",
            panel=Panel.PROXY,
            metavar="[NAME=]DIR",
            show_default="none",
            optional=True,
            multiple=True,
            value_type=str,
            convert=tuple,
        ),
    )
    """``[NAME=]DIR`` per model served on ``/v1/chat/completions`` (:meth:`chat_models`)."""

    # -- Replica sync
    replica_sync: bool = field(
        default=False,
        metadata=option(
            "--router-replica-sync",
            help="Share reservations with the other replicas over NATS: publish this router's AddRequest / "
            "MarkPrefillCompleted / Free, apply theirs; a late joiner takes a peer's snapshot.",
            panel=Panel.SYNC,
        ),
    )
    """Publish own reservations' events on NATS and apply the peers' (``kvrouter/bridge/``,
    ``docs/nats-bridge.md``)."""
    nats_url: str = field(
        default=DEFAULT_NATS_URL,
        metadata=option(
            "--nats-url",
            help="The NATS server of the replica sync (the first variable set wins).",
            panel=Panel.SYNC,
            env=("KVROUTER_NATS_URL", "NATS_SERVER"),
        ),
    )
    """The NATS server of the sync; ``NATS_SERVER`` is the variable the reference's clients read."""
    namespace: str = field(
        default="dynamo",
        metadata=option(
            "--namespace",
            help="Subjects are namespace.<namespace>.component.<component>.active_sequences_events.",
            panel=Panel.SYNC,
        ),
    )
    """The subjects' ``namespace.<namespace>`` (the reference's default)."""
    component: str = field(default="backend", metadata=option("--component", help="See --namespace.", panel=Panel.SYNC))
    """The subjects' ``component.<component>`` (the reference's default)."""
    active_request_expiry_secs: float = field(
        default=DEFAULT_EXPIRY_SECS,
        metadata=option(
            "--router-active-request-expiry-secs",
            help="[secs] A reservation neither freed nor completed (a peer's too: a replica that died) is "
            "dropped at this age.",
            panel=Panel.SYNC,
            min=0.001,
        ),
    )
    """A reservation (own, or a peer's learnt by the replica sync) neither freed nor completed is dropped at
    this age (the reference's 300 s)."""
    durable_kv_events: bool = field(
        default=False,
        metadata=option(
            "--router-durable-kv-events",
            "--durable-kv-events",
            help="Workers' NATS kv-events are kept in a JetStream stream this replica reads as a durable consumer; "
            "index snapshots go to the object store; a restarted replica resumes without asking any worker.",
            panel=Panel.SYNC,
        ),
    )
    """Workers' ``kv-events`` are kept in a JetStream stream this replica reads as a durable consumer, with
    index snapshots in the object store (``bridge/durable.py``)."""
    snapshot_threshold: int = field(
        default=DEFAULT_SNAPSHOT_THRESHOLD,
        metadata=option(
            "--router-snapshot-threshold",
            help="[messages] Durable mode: past this many messages in the stream, snapshot the index and "
            "purge the stream up to it.",
            panel=Panel.SYNC,
            min=1,
        ),
    )
    """Stream messages past which the index is snapshotted and the stream purged up to the snapshot (durable
    mode)."""
    reset_states: bool = field(
        default=False,
        metadata=option(
            "--router-reset-states",
            help="Durable mode: at start, delete the snapshot bucket and purge the stream.",
            panel=Panel.SYNC,
        ),
    )
    """At start, delete the snapshot bucket and purge the stream (durable mode)."""
    router_id: str | None = field(
        default=None,
        metadata=option(
            "--router-id",
            help="This replica's stable name (durable mode: its consumer is kvrouter-<id>, found again after a "
            "restart).",
            panel=Panel.SYNC,
            show_default="<hostname>-<port>",
        ),
    )
    """This replica's stable name, kept across restarts: its durable consumer is ``kvrouter-<router_id>``.
    None: derived from the host name and the port (``bridge/durable.py``)."""

    # -- not options
    health_interval_secs: float = 0.5
    """How often worker health (stale streams, dead ``http_endpoint``), shard status and the index
    summary are refreshed; ``/select`` reads the cached result."""
    decisions_ring: int = 1024
    events_ring: int = 1024

    def chat_models(self) -> list[tuple[str, str | None]]:
        """(model name, directory) per model served on ``/v1/chat/completions``: each ``--model-path``, then
        ``--model-name`` with ``--tokenizer --chat-template`` (directory None: those two files)."""
        out: list[tuple[str, str | None]] = []
        for entry in self.model_paths:
            name, sep, path = entry.partition("=")
            if not sep or os.sep in name or not name:
                name, path = self.model_name, entry
            out.append((name, path))
        if self.chat_template is not None:
            out.append((self.model_name, None))
        return out

    @property
    def exposed_without_auth(self) -> bool:
        """The API binds beyond this machine (:func:`is_loopback`) and no token guards its write routes."""
        return not self.auth_token and not is_loopback(self.host)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ServiceConfig.port must be in 0..65535, got {self.port}")
        if self.shards < 1:
            raise ConfigError(f"ServiceConfig.shards must be >= 1, got {self.shards}")
        if self.max_index_blocks < 0:
            raise ConfigError(f"ServiceConfig.max_index_blocks must be >= 0 (0: no cap), got {self.max_index_blocks}")
        if not 1 <= self.fronts <= MAX_FRONTS:
            raise ConfigError(f"ServiceConfig.fronts must be in 1..{MAX_FRONTS}, got {self.fronts}")
        if self.block_size < 1:
            raise ConfigError(f"ServiceConfig.block_size must be >= 1, got {self.block_size}")
        if self.overload_status != 429 and not 500 <= self.overload_status <= 599:
            raise ConfigError(f"ServiceConfig.overload_status must be 429 or 5xx, got {self.overload_status}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"ServiceConfig.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.drain_secs >= 0:
            raise ConfigError(f"ServiceConfig.drain_secs must be >= 0, got {self.drain_secs}")
        if not self.health_interval_secs > 0:
            raise ConfigError(f"ServiceConfig.health_interval_secs must be > 0, got {self.health_interval_secs}")
        if self.session_affinity_ttl_secs is not None and not self.session_affinity_ttl_secs > 0:
            raise ConfigError(
                f"ServiceConfig.session_affinity_ttl_secs must be > 0, got {self.session_affinity_ttl_secs}"
            )
        if self.decision_log is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.decision_log))):
            raise ConfigError(f"ServiceConfig.decision_log: no such directory for {self.decision_log!r}")
        if self.record is not None:
            if not os.path.isdir(os.path.dirname(os.path.abspath(self.record))):
                raise ConfigError(f"ServiceConfig.record: no such directory for {self.record!r}")
            if self.fronts > 1 or self.replica_sync:
                raise ConfigError(
                    "ServiceConfig.record: a recording covers one router's state; not with fronts > 1 or replica_sync"
                )
        if self.tokenizer is not None and not os.path.isfile(self.tokenizer):
            raise ConfigError(f"ServiceConfig.tokenizer: no such file {self.tokenizer!r}")
        if self.chat_template is not None and (self.tokenizer is None or not os.path.isfile(self.chat_template)):
            raise ConfigError(
                f"ServiceConfig.chat_template: needs a tokenizer and an existing file, got {self.chat_template!r}"
            )
        names = [name for name, _ in self.chat_models()]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"ServiceConfig.model_paths: model {name!r} is given {names.count(name)} times")
        for name, path in self.chat_models():
            if path is not None and not os.path.isdir(path):
                raise ConfigError(f"ServiceConfig.model_paths: {name}={path} is not a directory")
        if self.queue_threshold is not None and (type(self.queue_threshold) is not int or self.queue_threshold < 1):
            raise ConfigError(
                f"ServiceConfig.queue_threshold must be an integer >= 1 or None, got {self.queue_threshold!r}"
            )
        if self.queue_policy not in ("fcfs", "wspt"):
            raise ConfigError(f"ServiceConfig.queue_policy must be 'fcfs' or 'wspt', got {self.queue_policy!r}")
        if not self.queue_timeout_secs > 0:
            raise ConfigError(f"ServiceConfig.queue_timeout_secs must be > 0, got {self.queue_timeout_secs}")
        if not self.active_request_expiry_secs > 0:
            raise ConfigError(
                f"ServiceConfig.active_request_expiry_secs must be > 0, got {self.active_request_expiry_secs}"
            )
        Subjects(self.namespace, self.component)  # raises ConfigError naming the bad one
        for name in self.shadow_policies:
            if name not in POLICIES:
                raise ConfigError(f"ServiceConfig.shadow_policies: {name!r} is not one of {', '.join(POLICIES)}")
        if (self.replica_sync or self.durable_kv_events) and not self.nats_url.startswith(("nats://", "tls://")):
            raise ConfigError(
                f"ServiceConfig.nats_url must be nats://host:port or tls://host:port, got {self.nats_url!r}"
            )
        if self.durable_kv_events and not self.router.use_kv_events:
            raise ConfigError("ServiceConfig.durable_kv_events needs KV events (router.use_kv_events)")
        if type(self.snapshot_threshold) is not int or self.snapshot_threshold < 1:
            raise ConfigError(
                f"ServiceConfig.snapshot_threshold must be an integer >= 1, got {self.snapshot_threshold!r}"
            )
        if self.router_id is not None and not _ROUTER_ID.match(self.router_id):
            raise ConfigError(
                f"ServiceConfig.router_id must be 1-64 letters, digits, '_' or '-', got {self.router_id!r}"
            )
        if self.decisions_ring < 1 or self.events_ring < 1:
            raise ConfigError("ServiceConfig.decisions_ring and events_ring must be >= 1")
        if self.zmq_port == ZMQ_PORT_DEFAULT:
            if self.port == 65535:
                raise ConfigError("ServiceConfig.zmq_port: port + 1 is not a port; give zmq_port (or None)")
            object.__setattr__(self, "zmq_port", self.port + 1 if self.port else 0)
        if self.zmq_port is not None and not 0 <= self.zmq_port <= 65535:
            raise ConfigError(f"ServiceConfig.zmq_port must be in 0..65535 or None, got {self.zmq_port}")
        if self.zmq_port is not None and self.zmq_port and self.zmq_port == self.port:
            raise ConfigError(f"ServiceConfig.zmq_port must differ from port ({self.port})")
