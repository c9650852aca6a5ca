"""``ServiceConfig``: everything ``kvrouter up`` hands the service, immutable and validated once.

The service reads no flags or environment itself: the ``up`` command resolves flags, ``KVROUTER_*``
variables and the TOML file into this one object (``spec/interfaces.md`` §5), so tests build a service
from a literal and the precedence rules live in one place.
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
from ...plane.config import PlaneConfig
from ...plane.registry import WorkerSpec
from ...routing.config import KVROUTER_CONFIG, RouterConfig
from ...routing.slots import DEFAULT_EXPIRY_SECS
from ...sim.policies import POLICIES

__all__ = [
    "DEFAULT_NATS_URL",
    "DEFAULT_SNAPSHOT_THRESHOLD",
    "MAX_FRONTS",
    "ZMQ_PORT_DEFAULT",
    "ServiceConfig",
    "loopback",
]

DEFAULT_NATS_URL: Final = "nats://127.0.0.1:4222"
"""NATS's default client port on this machine."""
MAX_FRONTS: Final = 64
"""More front processes than this would be more than any machine's cores."""
DEFAULT_SNAPSHOT_THRESHOLD: Final = 1_000_000
"""Stream messages past which a durable replica snapshots the index: the reference's
``router_snapshot_threshold`` (``spec/dynamo-semantics.md`` §6.4)."""
_ROUTER_ID: Final = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
ZMQ_PORT_DEFAULT: Final = -1
"""``ServiceConfig.zmq_port``'s default: ``port + 1`` (a free port when ``port`` is 0)."""


def loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is reachable from this machine only: ``localhost`` or a loopback
    address (``127.0.0.0/8``, ``::1``). A service bound elsewhere without ``auth_token`` is warned about."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """How the service binds, which workers it starts with, how it routes and protects itself.

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

    host: str = "127.0.0.1"
    port: int = 8490
    """0 picks a free port (tests); ``Service.url`` tells which."""
    shards: int = 4
    """Applier processes of the one engine every partition shares."""
    max_index_blocks: int = MAX_INDEX_BLOCKS
    """``--max-index-blocks``: the index cap in (worker, block) entries over every shard and tier, each
    shard keeping ``max_index_blocks // shards`` (``index/writer.py``); 0: no cap."""
    block_size: int = 16
    """Block size of the partition of the workers given on the command line."""
    model_name: str = "default"
    routing_group: str = "default"
    workers: tuple[WorkerSpec, ...] = ()
    """``--workers``: registered in (``model_name``, ``routing_group``) when ``run`` starts."""
    router: RouterConfig = KVROUTER_CONFIG
    """Weights and switches of every partition's router; ``use_kv_events=False`` is approximate mode."""
    auth_token: str | None = None
    """Bearer token the write routes require; None leaves them open (and warns off loopback)."""
    overload_status: int = 529
    """Status when every candidate is over a busy threshold (529 as the reference; 429 for clients
    that cannot handle 529)."""
    max_body_bytes: int = 8 << 20
    """Request bodies above this are refused with 413 (the reference indexer's 8 MiB)."""
    drain_secs: float = 5.0
    """On stop, how long in-flight requests are given to finish before the sockets close."""
    health_interval_secs: float = 0.5
    """How often worker health (stale streams, dead ``http_endpoint``), shard status and the index
    summary are refreshed; ``/select`` reads the cached result."""
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    """The event plane's timers (``stale_after``, recovery timeout) for every registered worker."""
    decisions_ring: int = 1024
    events_ring: int = 1024
    zmq_port: int | None = ZMQ_PORT_DEFAULT
    """The ZMQ fast path's port (``fastpath.py``): None turns it off, 0 picks a free port; by default
    ``port + 1``, or a free port when ``port`` is 0. Resolved in ``__post_init__``: never -1 after."""
    session_affinity_ttl_secs: float | None = None
    """``--router-session-affinity-ttl-secs``: a session (``X-Dynamo-Session-ID``, ``session_id``) sticks
    to its first worker for this long since its last request; None turns affinity off."""
    tokenizer: str | None = None
    """``--tokenizer``: a local ``tokenizer.json`` for text prompts of ``/v1/completions``; None takes
    token-id prompts only."""
    queue_threshold: int | None = None
    """``--router-queue-threshold``: requests that find every worker of their partition busy wait in the
    partition's queue (``queue.py``), at most this many; None refuses them at once (``overload_status``)."""
    queue_policy: Literal["fcfs", "wspt"] = "fcfs"
    """``--router-queue-policy``: the queue's order, arrival (``fcfs``) or shortest prompt (``wspt``)."""
    queue_timeout_secs: float = 60.0
    """How long a request waits in the queue before it is refused with ``overload_status``."""
    active_request_expiry_secs: float = DEFAULT_EXPIRY_SECS
    """``--router-active-request-expiry-secs``: a reservation (own, or a peer's learnt by the replica
    sync) neither freed nor completed is dropped at this age (the reference's 300 s)."""
    replica_sync: bool = False
    """``--router-replica-sync``: publish own reservations' events on NATS and apply the peers'
    (``kvrouter/bridge/``, ``docs/nats-bridge.md``)."""
    nats_url: str = DEFAULT_NATS_URL
    """``--nats-url`` (env ``KVROUTER_NATS_URL``, then ``NATS_SERVER``): the NATS server of the sync."""
    namespace: str = "dynamo"
    """``--namespace``: the subjects' ``namespace.<namespace>`` (the reference's default)."""
    component: str = "backend"
    """``--component``: the subjects' ``component.<component>`` (the reference's default)."""
    durable_kv_events: bool = False
    """``--router-durable-kv-events``: workers' ``kv-events`` are kept in a JetStream stream this replica
    reads as a durable consumer, with index snapshots in the object store (``bridge/durable.py``)."""
    snapshot_threshold: int = DEFAULT_SNAPSHOT_THRESHOLD
    """``--router-snapshot-threshold``: stream messages past which the index is snapshotted and the
    stream purged up to the snapshot (durable mode)."""
    reset_states: bool = False
    """``--router-reset-states``: at start, delete the snapshot bucket and purge the stream (durable mode)."""
    router_id: str | None = None
    """``--router-id``: this replica's stable name, kept across restarts: its durable consumer is
    ``kvrouter-<router_id>``. None: derived from the host name and the port (``bridge/durable.py``)."""
    shadow_policies: tuple[str, ...] = ()
    """``--shadow-policy``: simulator policies asked on every decision, for comparison only (``shadow.py``)."""
    decision_log: str | None = None
    """``--decision-log FILE``: every decision appended to ``FILE`` as a JSON line (``decisions.py``)."""
    fronts: int = 1
    """``--fronts``: front processes serving ``port`` together (front 0 deals them connections), each
    reading the index through shared memory, their load views kept in step by the replica sync (``fronts.py``)."""
    record: str | None = None
    """``--record FILE``: the run's events, registrations and decisions written to ``FILE`` for
    ``kvrouter replay --from`` (``recording.py``)."""
    router_seed: int | None = None
    """``--router-seed``: every partition's router seed (with ``record``, written in the header); None: a
    fresh seed per router (drawn once for the header when recording)."""

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
