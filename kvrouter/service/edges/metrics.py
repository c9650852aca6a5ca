"""``GET /metrics``: the service, the event plane and the load, read at scrape time (Prometheus text).

Everything is read when Prometheus scrapes, nothing is pushed: a custom ``prometheus_client`` Collector
(:class:`ServiceCollector`) walks the engine's control segment (:meth:`Engine.stats`,
:meth:`Engine.workers`), every partition's :class:`~kvrouter.routing.slots.SlotManager` and the front's
plain counters, and builds the families then. The appliers are separate processes that already write
their counters into the control segment (``index/layout.py``); that segment *is* their report, so they
run no HTTP server of their own and the parent needs nothing from them but a read of shared memory
(a few µs per worker row). The rejected alternatives: prometheus-client's multiprocess mode (one
mmapped file per process and metric, written on every event, merged by globbing a directory at scrape
time: a second copy of what the control segment holds, and a write on the applier's hot loop); and
live ``Counter`` / ``Gauge`` objects updated on every event or decision, which would put a lock and a
label lookup on the decision path for figures that are only read every 15 s.

The front's own figures (decisions, selections per worker, hit rate, routing overhead per phase, HTTP
requests) are plain integers and :class:`Buckets` kept by the service (``Service.counters``); a bucket
observation is one ``bisect`` and two additions, no lock (one asyncio loop writes them; a scrape on the
same loop reads them between requests).

Each :class:`~prometheus_client.CollectorRegistry` is private to one service (:func:`install`), never
the process-global ``REGISTRY``: two services in one process (tests) do not collide, and the global
registry's default process/GC collectors are not exposed twice.

Names follow ``spec/interfaces.md`` §3.2: ``kvrouter_`` prefix, seconds, counters end in ``_total``,
labels carry ``worker_id`` / ``dp_rank`` / ``shard`` and the code's own kinds (``errors.py``'s
``EventError.kind``, ``WORKER_STATES``, the gap outcomes), never a request id or a hash. Where the
control segment holds no figure the spec proposes, the family is left out rather than faked:
events by type (``stored``/``removed``/``cleared``: the shard block counts events applied and
errors by kind, not types), an event-lag histogram (the shard block keeps one smoothed lag, exported
as a gauge, and the time of the last event, whose age is another) and a shard queue depth (the
appliers' ZMQ queues are not visible from here).

Cached blocks per storage tier are a family of their own, ``kvrouter_worker_tier_cached_blocks{worker_id,
dp_rank, tier}`` (``tier`` one of ``device``, ``host``, ``disk``, ``shared``; every tier always present),
beside ``kvrouter_worker_cached_blocks``, which stays the device count with the labels spec §3.2 fixes.
Giving the old family a ``tier`` label instead was rejected: each existing series would become four, so a
query, alert or recording rule selecting ``kvrouter_worker_cached_blocks{worker_id="1"}`` would silently
start summing host and disk blocks into what meant device blocks. The cost is one duplicated series per
worker (the device count is in both families).
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from ... import __version__, stdio
from ...bridge import ReplicaSync
from ...bridge.durable import DurableEvents
from ...engine import Engine, EngineView
from ...errors import EngineError
from ...events.model import WorkerKey
from ...index.layout import ERROR_KINDS, EVICT_REASONS, WORKER_STATES
from ...recording import Recorder
from ...routing.config import RouterConfig
from ...routing.slots import SlotManager
from ..core.counters import PREDICTION_FIELDS, SHADOW_FIELDS
from ..core.histogram import Buckets
from ..core.state import Core

__all__ = [
    "GAP_OUTCOMES",
    "Metrics",
    "MetricsHost",
    "PartitionLoad",
    "ServiceCollector",
    "exposition",
    "front_families",
    "identity_families",
]

log = logging.getLogger(__name__)

GAP_OUTCOMES: Final = ("detected", "recovered", "lost")
STATUS_CLASSES: Final = ("2xx", "3xx", "4xx", "5xx")


@dataclass(frozen=True, slots=True)
class PartitionLoad:
    """What the collector reads of one (model, routing group) partition."""

    model: str
    routing_group: str
    slots: SlotManager
    """The partition's router's slot manager: active blocks, prefill tokens, requests per worker."""
    workers: Sequence[WorkerKey] = field(default_factory=tuple)
    """Its registered (worker_id, dp_rank) keys: each gets a load series even when idle."""
    roles: Mapping[int, str] = field(default_factory=dict)
    """Each registered instance's role (``prefill``, ``decode``, ``both``)."""
    pending_by_priority: Mapping[int, int] = field(default_factory=dict)
    """The requests waiting in the partition's router queue (``queue.py``), per their own priority."""

    @property
    def pending(self) -> int:
        """Requests waiting in the partition's router queue."""
        return sum(self.pending_by_priority.values())


def _key_labels(key: WorkerKey) -> list[str]:
    return [str(key[0]), str(key[1])]


class ServiceCollector(Collector):
    """Builds every ``kvrouter_*`` family from live state at each scrape.

    Args:
        engine: the running engine whose control segment holds the appliers' and workers' counters.
        partitions: called at scrape time; the partitions' loads (none before the first ``/register``).
        front: called at scrape time; yields the front's own families (decisions, HTTP, overhead).
    """

    def __init__(
        self,
        engine: Engine | EngineView,
        *,
        partitions: Callable[[], Iterable[PartitionLoad]] = tuple,
        front: Callable[[], Iterable[Metric]] = tuple,
    ) -> None:
        self.engine = engine
        self.partitions = partitions
        self.front = front
        self._failed_once = False

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvrouter_build_info", "kvrouter's version and Python's", labels=["version", "python"])
        info.add_metric([__version__, platform.python_version()], 1.0)
        yield info
        try:
            yield from self._engine_families()
        except EngineError as exc:  # stopped (shutdown racing a scrape): the rest still answers
            if not self._failed_once:
                log.warning("metrics engine unreadable error=%s", exc)
                self._failed_once = True
        yield from self._load_families(list(self.partitions()))
        yield from self.front()

    # -- the appliers and the event plane (control segment) ---------------------------------------

    def _engine_families(self) -> Iterator[Metric]:
        shards = self.engine.stats()
        workers = self.engine.workers()
        now_ns = time.time_ns()
        up = GaugeMetricFamily("kvrouter_shard_up", "1 when the shard's applier serves (status up)", labels=["shard"])
        status = GaugeMetricFamily(
            "kvrouter_shard_status", "The shard's status, one series per status set to 1", labels=["shard", "status"]
        )
        restarts = CounterMetricFamily("kvrouter_shard_restarts", "Applier restarts of the shard", labels=["shard"])
        epoch = GaugeMetricFamily("kvrouter_shard_epoch", "Bumped with every new shard segment", labels=["shard"])
        applied = CounterMetricFamily(
            "kvrouter_kv_events", "Events the shard's applier took (applied or rejected)", labels=["shard"]
        )
        rejected = CounterMetricFamily(
            "kvrouter_kv_events_rejected",
            "Events and undecodable batches the appliers rejected, by error kind (EventError.kind)",
            labels=["kind"],
        )
        age = GaugeMetricFamily(
            "kvrouter_shard_last_event_age_seconds",
            "Seconds since the shard last applied an event (absent before the first)",
            labels=["shard"],
        )
        lag = GaugeMetricFamily(
            "kvrouter_index_lag_seconds",
            "Engine stamp to applied in the index, smoothed over the shard's batches (absent before the first)",
            labels=["shard"],
        )
        cap = GaugeMetricFamily(
            "kvrouter_index_blocks_cap",
            "The index cap (--max-index-blocks) as the shards keep it: the sum of their budgets (0: no cap)",
        )
        used = GaugeMetricFamily(
            "kvrouter_index_blocks", "(worker, block) entries in the index, every tier: what the cap counts"
        )
        evictions = CounterMetricFamily(
            "kvrouter_index_evictions",
            "Entries the index cap evicted, by reason (untrusted: its worker was not exact; lru: least recently"
            " stored)",
            labels=["reason"],
        )
        after_eviction = CounterMetricFamily(
            "kvrouter_index_events_after_eviction",
            "Events naming a block the cap had evicted from their worker (a Removed of it, a Stored under it)",
        )
        touched = CounterMetricFamily(
            "kvrouter_index_matched_blocks",
            "Blocks the decisions matched, fed back to the appliers for the cap's least recently used order",
        )
        evicted_by_reason = dict.fromkeys(EVICT_REASONS, 0)
        errors = dict.fromkeys(ERROR_KINDS, 0)
        for shard in shards:
            label = str(shard.shard)
            up.add_metric([label], 1.0 if shard.status == "up" else 0.0)
            for name in ("starting", "up", "recovering", "stopped"):
                status.add_metric([label, name], 1.0 if shard.status == name else 0.0)
            restarts.add_metric([label], shard.restarts)
            epoch.add_metric([label], shard.epoch)
            applied.add_metric([label], shard.events_applied)
            if shard.last_event_ns:
                age.add_metric([label], max(0.0, (now_ns - shard.last_event_ns) / 1e9))
            if shard.lag_us:
                lag.add_metric([label], shard.lag_us / 1e6)
            for kind, count in shard.errors.items():
                errors[kind] = errors.get(kind, 0) + count
            for reason, count in shard.evicted.items():
                evicted_by_reason[reason] = evicted_by_reason.get(reason, 0) + count
        for kind, count in errors.items():
            rejected.add_metric([kind], count)
        cap.add_metric([], sum(shard.budget for shard in shards))
        used.add_metric([], sum(shard.entries for shard in shards))
        for reason, count in evicted_by_reason.items():
            evictions.add_metric([reason], count)
        after_eviction.add_metric([], sum(shard.after_eviction for shard in shards))
        touched.add_metric([], sum(shard.touched for shard in shards))
        yield from (up, status, restarts, epoch, applied, rejected, age, lag)
        yield from (cap, used, evictions, after_eviction, touched)

        labels = ["worker_id", "dp_rank"]
        cached = GaugeMetricFamily("kvrouter_worker_cached_blocks", "Device blocks the index holds", labels=labels)
        by_tier = GaugeMetricFamily(
            "kvrouter_worker_tier_cached_blocks",
            "Blocks the index holds per storage tier (device, host, disk, shared)",
            labels=[*labels, "tier"],
        )
        gaps = CounterMetricFamily(
            "kvrouter_kv_event_gaps",
            "Sequence gaps in a worker's event stream, by outcome (detected = recovered + lost + in flight)",
            labels=[*labels, "outcome"],
        )
        events = CounterMetricFamily(
            "kvrouter_worker_kv_events", "Events applied from the worker's stream", labels=labels
        )
        bad_frames = CounterMetricFamily(
            "kvrouter_worker_bad_frames", "Frames from the worker that did not decode", labels=labels
        )
        dropped = CounterMetricFamily(
            "kvrouter_worker_dropped_blocks", "Blocks not indexed: another block size than registered", labels=labels
        )
        skipped = CounterMetricFamily(
            "kvrouter_worker_skipped_events", "Events of another attention group, skipped", labels=labels
        )
        engine_restarts = CounterMetricFamily(
            "kvrouter_worker_restarts", "Engine restarts seen in the stream (ids back to 0)", labels=labels
        )
        worker_evicted = CounterMetricFamily(
            "kvrouter_worker_evicted_blocks",
            "The worker's entries the index cap evicted, by reason (untrusted, lru)",
            labels=[*labels, "reason"],
        )
        state = GaugeMetricFamily(
            "kvrouter_worker_state",
            "How far the index can be trusted for the worker, one series per state set to 1",
            labels=[*labels, "state"],
        )
        stale = GaugeMetricFamily("kvrouter_worker_stale", "1 when nothing was heard for stale_after", labels=labels)
        last = GaugeMetricFamily(
            "kvrouter_worker_last_event_age_seconds",
            "Seconds since the worker's last message (or its registration)",
            labels=labels,
        )
        listeners = GaugeMetricFamily(
            "kvrouter_listeners", "Followed (worker, dp_rank) streams by state", labels=["status"]
        )
        by_state = dict.fromkeys(WORKER_STATES.values(), 0)
        for key, row in sorted(workers.items()):
            values = _key_labels(key)
            cached.add_metric(values, row.cached_blocks)
            for tier, count in row.cached_by_tier.items():
                by_tier.add_metric([*values, tier], count)
            for outcome, count in zip(
                GAP_OUTCOMES, (row.gaps_detected, row.gaps_recovered, row.gaps_lost), strict=True
            ):
                gaps.add_metric([*values, outcome], count)
            events.add_metric(values, row.events)
            bad_frames.add_metric(values, row.bad_frames)
            dropped.add_metric(values, row.dropped_blocks)
            skipped.add_metric(values, row.skipped_events)
            engine_restarts.add_metric(values, row.restarts)
            for reason, count in row.evicted.items():
                worker_evicted.add_metric([*values, reason], count)
            for name in WORKER_STATES.values():
                state.add_metric([*values, name], 1.0 if row.state == name else 0.0)
            stale.add_metric(values, 1.0 if row.stale else 0.0)
            if row.last_event_ns:
                last.add_metric(values, max(0.0, (now_ns - row.last_event_ns) / 1e9))
            by_state[row.state] = by_state.get(row.state, 0) + 1
        for name, count in by_state.items():
            listeners.add_metric([name], count)
        yield from (cached, by_tier, gaps, events, bad_frames, dropped, skipped, engine_restarts, worker_evicted)
        yield from (state, stale, last)
        yield listeners

    # -- the load the front booked (slot managers) --------------------------------------------

    def _load_families(self, partitions: Sequence[PartitionLoad]) -> Iterator[Metric]:
        labels = ["worker_id", "dp_rank"]
        count = GaugeMetricFamily(
            "kvrouter_workers", "Registered (worker, dp_rank) keys per partition", labels=["model", "routing_group"]
        )
        blocks = GaugeMetricFamily(
            "kvrouter_worker_active_decode_blocks",
            "Distinct KV blocks of the worker's active requests (a shared prefix counts once)",
            labels=labels,
        )
        prefill = GaugeMetricFamily(
            "kvrouter_worker_active_prefill_tokens",
            "Prompt tokens of the worker's requests that have no first token yet",
            labels=labels,
        )
        requests = GaugeMetricFamily(
            "kvrouter_worker_active_requests", "Requests routed to the worker and not freed", labels=labels
        )
        pending = GaugeMetricFamily(
            "kvrouter_router_queue_pending_requests",
            "Requests waiting in the partition's router queue (--router-queue-threshold)",
            labels=["model", "routing_group"],
        )
        role = GaugeMetricFamily(
            "kvrouter_worker_role",
            "1 for the role each registered worker (instance) takes: prefill, decode or both",
            labels=["worker", "role"],
        )
        by_priority = GaugeMetricFamily(
            "kvrouter_queue_pending_by_priority",
            "Requests waiting in the partition's router queue, by their own priority (lower first)",
            labels=["model", "priority"],
        )
        for partition in partitions:
            for klass, waiting in sorted(partition.pending_by_priority.items()):
                by_priority.add_metric([partition.model, str(klass)], waiting)
            for worker, name in sorted(partition.roles.items()):
                role.add_metric([str(worker), name], 1.0)
            count.add_metric([partition.model, partition.routing_group], len(partition.workers))
            pending.add_metric([partition.model, partition.routing_group], partition.pending)
            slots = partition.slots
            keys = dict.fromkeys(partition.workers)
            keys.update(dict.fromkeys(slots.workers()))
            for key in sorted(keys):
                values = _key_labels(key)
                blocks.add_metric(values, slots.active_blocks(key))
                prefill.add_metric(values, slots.active_prefill_tokens(key))
                requests.add_metric(values, slots.active_requests(key))
        yield from (count, blocks, prefill, requests, pending, by_priority, role)


def histogram(
    name: str, documentation: str, series: Mapping[tuple[str, ...], Buckets], labels: Sequence[str]
) -> Metric:
    """A histogram family from :class:`Buckets` keyed by label values (``()`` for an unlabelled one)."""
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    for values, buckets in series.items():
        family.add_metric(list(values), buckets.cumulative(), sum_value=buckets.sum)
    return family


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition of every family in ``registry``."""
    return generate_latest(registry)


# -- the service: what install() reads ----------------------------------------------------------


class Counters(Protocol):
    """What the collector reads of ``Service.counters`` (``counters.ServiceCounters``)."""

    decisions: int
    reservations: int
    selections: dict[WorkerKey, int]
    overlap_blocks: int
    prompt_blocks: int
    overloaded: int
    no_worker: int
    expired_reservations: int
    connections: int
    handovers: int
    shared_failures: int
    decision: Buckets
    hit_rate: Buckets
    phases: dict[str, Buckets]
    http_requests: dict[tuple[str, str], int]
    http_errors: dict[tuple[str, str], int]
    http_seconds: dict[tuple[str, str], float]
    reuse: dict[WorkerKey, list[int]]
    reuse_error: dict[WorkerKey, Buckets]
    predictions: dict[WorkerKey, list[int]]
    shadow: dict[str, list[float]]


class AccuracyView(Protocol):
    drifting: set[WorkerKey]

    def rolling(self, worker: WorkerKey) -> float | None: ...


class MetricsHost(Protocol):
    """What :class:`Metrics` needs of the process beside the core: the engine, the counters of every front,
    and the optional parts (replica sync, durable events, the recording)."""

    @property
    def engine(self) -> Engine | EngineView: ...
    def fleet_counters(self) -> Counters: ...
    @property
    def started_at(self) -> float: ...
    @property
    def sync(self) -> ReplicaSync | None: ...
    @property
    def durable(self) -> DurableEvents | None: ...
    @property
    def recorder(self) -> Recorder | None: ...


SYNC_EVENT_KINDS: Final = (
    "published",
    "applied",
    "ignored_own",
    "malformed",
    "unknown_worker",
    "duplicate",
    "unknown_request",
    "dropped",
    "snapshot_received",
    "snapshots_served",
    "expired_pending",
    "disconnects",
    "reconnects",
    "slow_consumer",
    "resyncs",
    "resync_added",
    "resync_freed",
    "resync_updated",
    "resync_republished",
)
"""``kvrouter_replica_sync_events``' kinds: ``SyncCounters``' fields."""


def replica_sync_families(sync: ReplicaSync) -> Iterator[Metric]:
    """The replica sync (``bridge/sync.py``): connected and joined, its events by kind, its queue and the
    peers' requests kept for workers not registered here."""
    status = sync.status()
    connected = GaugeMetricFamily("kvrouter_replica_sync_connected", "1 while the replica sync is connected to NATS")
    connected.add_metric([], 1.0 if status["connected"] else 0.0)
    joined = GaugeMetricFamily("kvrouter_replica_sync_joined", "1 once the late-join snapshot is applied (or no peer)")
    joined.add_metric([], 1.0 if status["joined"] else 0.0)
    events = CounterMetricFamily(
        "kvrouter_replica_sync_events", "Replica-sync events by kind (published, applied, refused ...)", labels=["kind"]
    )
    for kind in SYNC_EVENT_KINDS:
        events.add_metric([kind], status[kind])
    resyncing = GaugeMetricFamily(
        "kvrouter_replica_sync_resyncing", "1 while a re-sync (after a reconnect or a slow consumer) is due or running"
    )
    resyncing.add_metric([], 0.0 if status["resyncing"] is None else 1.0)
    queued = GaugeMetricFamily("kvrouter_replica_sync_queued", "Own events waiting to be published")
    queued.add_metric([], status["queued"])
    pending = GaugeMetricFamily(
        "kvrouter_replica_sync_pending", "Peers' requests kept for workers not registered here yet"
    )
    pending.add_metric([], status["pending"])
    peers = GaugeMetricFamily("kvrouter_replica_sync_peers", "Other replicas heard on the presence subject lately")
    peers.add_metric([], status["peers"])
    yield from (connected, joined, resyncing, events, queued, pending, peers)
    if status["sync_lag_ms"] is not None:
        lag = GaugeMetricFamily(
            "kvrouter_replica_sync_lag_seconds", "Median one-way delay of the peers' last presence messages"
        )
        lag.add_metric([], status["sync_lag_ms"] / 1e3)
        yield lag


DURABLE_EVENT_KINDS: Final = (
    "received",
    "redelivered",
    "snapshot_loads",
    "snapshot_uploads",
    "snapshot_bad",
    "snapshot_failures",
    "purged",
)
"""``kvrouter_durable_events``' kinds: ``DurableCounters``' fields."""
RELAY_EVENT_KINDS: Final = ("duplicates", "gaps", "restarts", "queries", "bad_queries", "malformed", "oversized")
"""The relay's counters reported beside them in durable mode (``RelayCounters``' fields)."""


def recording_families(recorder: Recorder) -> Iterator[Metric]:
    """``--record FILE`` (``recording/writer.py``): records written, and those dropped rather than waited for."""
    written = CounterMetricFamily("kvrouter_recording_records", "Records written to the --record file")
    written.add_metric([], recorder.written)
    dropped = CounterMetricFamily(
        "kvrouter_recording_dropped",
        "Records dropped because the writer fell behind: the front's queue full (front), or lost on the way "
        "from an applier (applier)",
        labels=["source"],
    )
    dropped.add_metric(["front"], recorder.dropped)
    dropped.add_metric(["applier"], recorder.tap_dropped)
    yield from (written, dropped)


def durable_families(durable: DurableEvents) -> Iterator[Metric]:
    """Durable mode (``bridge/durable.py``): caught up, the stream position, what was received, dropped,
    snapshotted and purged."""
    status = durable.status()
    relay = durable.relay.status()
    caught_up = GaugeMetricFamily(
        "kvrouter_durable_caught_up", "1 once the stream is processed up to its last sequence at start"
    )
    caught_up.add_metric([], 1.0 if status["caught_up"] else 0.0)
    seq = GaugeMetricFamily("kvrouter_durable_processed_seq", "The last stream sequence relayed")
    seq.add_metric([], status["processed_seq"])
    events = CounterMetricFamily(
        "kvrouter_durable_events", "Durable-mode messages, duplicates, snapshots and purges by kind", labels=["kind"]
    )
    for kind in DURABLE_EVENT_KINDS:
        events.add_metric([kind], status[kind])
    for kind in RELAY_EVENT_KINDS:
        events.add_metric([kind], relay[kind])
    yield from (caught_up, seq, events)


def identity_families(started_at: float, config: RouterConfig) -> Iterator[Metric]:
    """When the service started and the routing weights it applies: what ``kvrouter top --url`` shows in its
    header (the local dashboard reads them from the stats segment)."""
    start = GaugeMetricFamily("kvrouter_start_time_seconds", "When the service started, seconds since the epoch")
    start.add_metric([], started_at)
    weights = GaugeMetricFamily(
        "kvrouter_router_weight", "The routing weights in effect, by kvrouter top's short name", labels=["name"]
    )
    for name, value in config.short_weights().items():
        weights.add_metric([name], float(value))
    yield from (start, weights)


def front_families(counters: Counters) -> Iterator[Metric]:
    """The front's figures: decisions, selections per worker, hit-rate sums and histogram, refusals,
    decision latency, the time per phase of a ``/select``, HTTP requests / errors / time."""
    decisions = CounterMetricFamily("kvrouter_decisions", "Routing decisions made (/select and reservations)")
    decisions.add_metric([], counters.decisions)
    reservations = CounterMetricFamily("kvrouter_reservations", "Decisions that booked load (/select_and_reserve)")
    reservations.add_metric([], counters.reservations)
    selections = CounterMetricFamily(
        "kvrouter_selections", "Decisions per chosen worker", labels=["worker_id", "dp_rank"]
    )
    for key, count in sorted(counters.selections.items()):
        selections.add_metric(_key_labels(key), count)
    overlap = CounterMetricFamily(
        "kvrouter_selected_overlap_blocks",
        "Device blocks the chosen worker held of the prompt, summed over decisions (÷ prompt blocks = hit rate)",
    )
    overlap.add_metric([], counters.overlap_blocks)
    prompt = CounterMetricFamily("kvrouter_prompt_blocks", "Full blocks of the routed prompts, summed")
    prompt.add_metric([], counters.prompt_blocks)
    refused = CounterMetricFamily(
        "kvrouter_refused_requests", "Requests no worker was chosen for, by reason", labels=["reason"]
    )
    refused.add_metric(["overloaded"], counters.overloaded)
    refused.add_metric(["no_worker"], counters.no_worker)
    expired = CounterMetricFamily("kvrouter_expired_reservations", "Reservations dropped at expiry, never freed")
    expired.add_metric([], counters.expired_reservations)
    latency = histogram(
        "kvrouter_decision_seconds",
        "Time of one decision: index walk, costs and choice (Router.select)",
        {(): counters.decision},
        [],
    )
    yield from (decisions, reservations, selections, overlap, prompt, refused, expired, latency)

    requests = CounterMetricFamily("kvrouter_http_requests", "HTTP requests answered", labels=["endpoint", "method"])
    seconds = SummaryMetricFamily(
        "kvrouter_http_request_duration_seconds",
        "Time from routing a request to its response, per route and method",
        labels=["endpoint", "method"],
    )
    for route, count in sorted(counters.http_requests.items()):
        requests.add_metric(list(route), count)
        seconds.add_metric(list(route), count_value=count, sum_value=counters.http_seconds.get(route, 0.0))
    errors = CounterMetricFamily(
        "kvrouter_http_errors", "HTTP answers of status 400 and above", labels=["endpoint", "status_class"]
    )
    for route_class, count in sorted(counters.http_errors.items()):
        errors.add_metric(list(route_class), count)
    connections = CounterMetricFamily(
        "kvrouter_http_connections",
        "HTTP connections accepted, by the layer that served them to the end",
        labels=["layer"],
    )
    connections.add_metric(["lane"], counters.connections - counters.handovers)
    connections.add_metric(["aiohttp"], counters.handovers)
    shared = CounterMetricFamily(
        "kvrouter_shared_connection_failures",
        "Connections a front closed because serving its share of them failed (--fronts N; logged)",
    )
    shared.add_metric([], counters.shared_failures)
    yield from (requests, seconds, errors, connections, shared)

    yield histogram(
        "kvrouter_kv_hit_rate", "Predicted hit rate of the chosen worker per decision", {(): counters.hit_rate}, []
    )
    yield from reuse_families(counters)
    yield prediction_family(counters)
    yield from shadow_families(counters)
    series: dict[tuple[str, ...], Buckets] = {(name,): b for name, b in counters.phases.items()}
    yield histogram(
        "kvrouter_routing_overhead_seconds",
        "Time per phase of a /select: parse (body to request), hash (tokens to blocks), decide, serialise, total",
        series,
        ["phase"],
    )


def reuse_families(counters: Counters) -> Iterator[Metric]:
    """Predicted against engine-reported reuse per worker (``accuracy.py``), every front's reports."""
    labels = ["worker_id", "dp_rank"]
    reports = CounterMetricFamily(
        "kvrouter_worker_reuse_reports",
        "Engine reports of reused prompt tokens, by how they compare with the router's prediction in whole blocks "
        "(exact; over: the index held blocks the engine had not; under: the reverse)",
        labels=[*labels, "outcome"],
    )
    predicted = CounterMetricFamily(
        "kvrouter_worker_reuse_predicted_tokens", "Predicted overlap in tokens of the reported requests", labels=labels
    )
    actual = CounterMetricFamily(
        "kvrouter_worker_reuse_actual_tokens", "Prompt tokens the engine reported it reused", labels=labels
    )
    for key, counts in sorted(counters.reuse.items()):
        values = _key_labels(key)
        for outcome, count in zip(("exact", "over", "under"), counts[1:4], strict=True):
            reports.add_metric([*values, outcome], count)
        predicted.add_metric(values, counts[4])
        actual.add_metric(values, counts[5])
    yield from (reports, predicted, actual)
    yield histogram(
        "kvrouter_worker_reuse_error_blocks",
        "Per report, blocks the engine reused minus blocks the router predicted",
        {tuple(_key_labels(k)): b for k, b in sorted(counters.reuse_error.items())},
        labels,
    )


def prediction_family(counters: Counters) -> Metric:
    """The predicted tier's bets per worker and how they ended (``core/predictions.py``), every front's."""
    family = CounterMetricFamily(
        "kvrouter_worker_predictions",
        "Reservations booked with prompt blocks predicted in flight on their worker (made), and how they ended: "
        "confirmed (the index held them when freed), contradicted (it did not, or the worker restarted or left), "
        "expired (never freed)",
        labels=["worker_id", "dp_rank", "outcome"],
    )
    for key, counts in sorted(counters.predictions.items()):
        values = _key_labels(key)
        for outcome, count in zip(PREDICTION_FIELDS, counts, strict=True):
            family.add_metric([*values, outcome], count)
    return family


def shadow_families(counters: Counters) -> Iterator[Metric]:
    """``--shadow-policy``: each shadow's picks against the live ones over the same decisions (``shadow.py``)."""
    if not counters.shadow:
        return
    families = {
        "decisions": CounterMetricFamily(
            "kvrouter_shadow_decisions", "Decisions a shadow policy was asked", labels=["policy"]
        ),
        "agreements": CounterMetricFamily(
            "kvrouter_shadow_agreements", "Decisions where the shadow chose the live worker", labels=["policy"]
        ),
        "overlap_blocks": CounterMetricFamily(
            "kvrouter_shadow_overlap_blocks", "Device overlap of the shadow's picks, summed", labels=["policy"]
        ),
        "live_overlap_blocks": CounterMetricFamily(
            "kvrouter_shadow_live_overlap_blocks", "Device overlap of the live picks, same decisions", labels=["policy"]
        ),
        "cost": CounterMetricFamily(
            "kvrouter_shadow_cost", "The live cost function's value of the shadow's picks, summed", labels=["policy"]
        ),
        "live_cost": CounterMetricFamily(
            "kvrouter_shadow_live_cost", "The live picks' cost, over the same decisions", labels=["policy"]
        ),
    }
    for policy, values in sorted(counters.shadow.items()):
        for name, value in zip(SHADOW_FIELDS, values, strict=True):
            families[name].add_metric([policy], value)
    yield from families.values()


def accuracy_families(accuracy: AccuracyView, workers: Iterable[WorkerKey]) -> Iterator[Metric]:
    """This front's rolling accuracy and drift per worker (``accuracy.py``)."""
    labels = ["worker_id", "dp_rank"]
    share = GaugeMetricFamily(
        "kvrouter_worker_index_accuracy",
        "Share of the worker's last reuse reports on this front that matched the prediction (needs 20 reports)",
        labels=labels,
    )
    drift = GaugeMetricFamily(
        "kvrouter_worker_accuracy_drift",
        "1 while the worker's index accuracy is below the drift threshold",
        labels=labels,
    )
    for key in sorted(workers):
        rolling = accuracy.rolling(key)
        if rolling is not None:
            share.add_metric(_key_labels(key), rolling)
        drift.add_metric(_key_labels(key), 1.0 if key in accuracy.drifting else 0.0)
    yield from (share, drift)


def output_families() -> Iterator[Metric]:
    """Writes to this process's closed stdout or stderr, dropped (``kvrouter/stdio.py``)."""
    dropped = CounterMetricFamily(
        "kvrouter_output_dropped_writes", "Writes to a closed stdout or stderr, dropped", labels=["stream"]
    )
    for name, count in stdio.dropped().items():
        dropped.add_metric([name], count)
    yield dropped


class Metrics:
    """``GET /metrics`` of one service, on a registry of its own: :meth:`add_to` adds the route."""

    def __init__(self, core: Core, host: MetricsHost) -> None:
        self.core = core
        self.host = host
        self.registry = CollectorRegistry()
        self.registry.register(ServiceCollector(host.engine, partitions=self._partitions, front=self._front))

    def add_to(self, app: web.Application) -> None:
        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app.router.add_get("/metrics", metrics)

    def _partitions(self) -> list[PartitionLoad]:
        queue = self.core.queue
        return [
            PartitionLoad(
                p.model_name,
                p.routing_group,
                p.slots,
                tuple(p.worker_keys()),
                {iid: instance.role for iid, instance in p.instances.items()},
                queue.pending_by_priority(p.model_name, p.routing_group),
            )
            for p in list(self.core.registry.partitions.values())
        ]

    def _front(self) -> Iterator[Metric]:
        core, host = self.core, self.host
        yield from identity_families(host.started_at, core.config.router)
        yield from front_families(host.fleet_counters())
        workers = [key for p in list(core.registry.partitions.values()) for key in p.worker_keys()]
        yield from accuracy_families(core.accuracy, workers)
        yield from output_families()
        waits: dict[tuple[str, ...], Buckets] = {(str(k),): b for k, b in sorted(core.queue.waits.items())}
        yield histogram(
            "kvrouter_router_queue_wait_seconds",
            "How long requests decided from the router queue waited, by their own priority",
            waits,
            ["priority"],
        )
        if host.sync is not None:
            yield from replica_sync_families(host.sync)
        if host.durable is not None:
            yield from durable_families(host.durable)
        if host.recorder is not None:
            yield from recording_families(host.recorder)
