"""``Service``: the router front: one asyncio loop serving the HTTP API over one shared-memory engine.

The process layout is ``kvrouter up``'s (``plan``, ``spec/interfaces.md`` §2): this process owns one
:class:`~kvrouter.engine.Engine` (its appliers are forked, before the loop starts, by
:meth:`Service.start`) and answers every request on one event loop. Every route is a few microseconds
of synchronous work (parse, hash, one index read through shared memory, one compiled decision), so one
loop with no locks is both the simplest and the fastest layout: a thread pool would add a hand-off per
request and a lock around every router, and gain nothing on two cores.

This module holds what the service is: its lifecycle, its registry of workers (partitions,
``partition.py``, one per (model, routing group)) and its decisions (select, reservations). What
serves it lives beside it, one job each: the HTTP API in ``routes.py``, the health loop and ``/ready``
in ``health.py``, the answers' JSON shape in ``answers.py``, the counters in ``counters.py``; the ZMQ
fast path, the proxy, the router queue and ``/metrics`` install themselves from their own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from aiohttp import web

from ..bridge import ReplicaSync, Subjects, localbus
from ..bridge.durable import DurableEvents, consumer_name
from ..bridge.events import NatsEventRelay
from ..engine import Engine, EngineView, WorkerStats
from ..errors import (
    ConfigError,
    DuplicateRequest,
    EngineError,
    InvalidHashInput,
    KvRouterError,
    NoWorkerAvailable,
    ServiceError,
)
from ..events.model import StorageTier, WorkerKey
from ..hashing import block_hashes_array, sequence_hashes_array
from ..plane.registry import offset_endpoint
from ..recording import Recorder
from ..routing.config import RouterConfig
from ..routing.router import Router, Selection
from ..routing.slots import SlotManager
from ..stats import discovery
from ..stats.segment import EXPLAIN_INTERVAL_S
from . import fastparse, fastpath, metrics, proxy
from .accuracy import Accuracy
from .affinity import Affinity
from .answers import address, explain
from .core.config import ServiceConfig
from .counters import PHASES, ServiceCounters
from .decisions import DecisionLog, DecisionRecords, Recorded, decision_json
from .fastpath import FastPath
from .fronts import Fronts, FrontSpec
from .health import Health
from .lane import Lane
from .partition import Instance, Partition
from .queue import RouterQueue
from .recording import ServiceRecording, tap_endpoint
from .routes import Routes
from .shadow import ShadowChoice, Shadows
from .sharing import Sharing
from .stats import StatsPublisher
from .trust import Trust
from .validation import Registration, SelectRequest, Unregistration, parse_registration, parse_unregistration

__all__ = ["PHASES", "SelectResult", "Service", "ServiceCounters"]

log = logging.getLogger(__name__)

ABANDON_START_S: Final = 1.0
"""How long a stop in the middle of the start waits for the start to end before leaving it behind: the
engine's close ends a wait for the appliers at once, but the front's compile (seconds to a minute on a
cold numba cache) cannot be cut short, and SIGTERM must end ``kvrouter up`` within 10 s."""
MATCHED_LIMIT: Final = 256
"""Decisions whose matched blocks one health tick feeds to the index cap's order (``Service.feed_matches``):
past it a tick's further decisions are left out (a busy router's recency is then a sample, which is all an
order among millions of blocks needs), so neither the list nor the tick's work grows with the decision rate.
The tick hashes on the event loop: at 4,096 a busy front stalled every request for about 10 ms twice a
second (``bench_service``'s p99 at concurrency 8: 12.5 ms, 4.9 ms without feeding)."""
SYNC_GRACE_S: Final = 0.5
"""How long ``/reservations/{id}/prefill_complete`` and ``DELETE /reservations/{id}`` wait, with replica sync
connected, for a reservation this replica (or front) has not heard of yet before answering 404. Its booking
travels from the replica that made it over NATS or the local bus (milliseconds, tens on a loaded machine),
while a client behind a load balancer that is not sticky may send its next call to another replica at once:
without the wait that call was refused, and the reservation's prefill stayed counted on every replica."""
SYNC_POLL_S: Final = 0.005
"""How often :meth:`Service.hear_of` looks again. A poll, not a wake-up from the sync's ``synced`` callback:
the wait is rare and bounded, and a poll keeps no waiters to clean up when a booking never comes."""
FEED_SLICE: Final = 8
"""Prompts ``feed_matches`` hashes, or workers it sends their blocks, before it lets the event loop serve
requests again (about 0.2 ms)."""


@dataclass(slots=True)
class SelectResult:
    """One decision, as ``/select`` answers it."""

    partition: Partition
    selection: Selection
    selection_id: str | None
    """The reservation id when the request was booked (``select_and_reserve``), else the client's id."""
    reserved: bool
    fallbacks: list[tuple[WorkerKey, float]]
    """The next-best eligible workers with their costs, cheapest first."""
    endpoint: str | None
    address: str | None


@dataclass(slots=True)
class _Reservation:
    partition: Partition
    worker: WorkerKey
    at: float
    """``time.monotonic()`` when booked."""
    predicted: int | None = None
    """The chosen worker's predicted overlap in tokens (own reservations; a peer's is not known here)."""
    reported: bool = False
    """The engine's reuse was reported (``accuracy.py``): one report per reservation."""


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Service:
    """The router service: partitions, reservations, the HTTP API and its lifecycle.

    Use: ``service = Service(config); service.start()`` (forks the appliers: before any thread or
    loop), then ``asyncio.run(service.run(on_ready=...))`` until :meth:`stop`. Routes may be added to
    :attr:`app` before ``run``. The Python methods (:meth:`register`, :meth:`select`, ...) do what their
    routes do and raise :class:`~kvrouter.errors.ServiceError` with the route's status; they must be
    called on the service's event loop (or before ``run``).
    """

    def __init__(self, config: ServiceConfig, *, front: FrontSpec | None = None) -> None:
        self.config = config
        self.recording: ServiceRecording | None = None
        """``--record FILE`` (recording.py): the front's records, the held clock and the seed."""
        plane = config.plane
        if config.record is not None and front is None:
            endpoint = tap_endpoint(config.record)
            plane = replace(plane, record_endpoint=endpoint)  # every applier copies what it applies there
            self.recording = ServiceRecording(config, endpoint)
        self.engine: Engine | EngineView = (
            Engine(shards=config.shards, plane=plane, max_index_blocks=config.max_index_blocks)
            if front is None
            else EngineView(front.handle, front.applier_endpoints)
        )
        """Front 0 owns the engine; another front of ``--fronts N`` maps it read-only (``fronts.py``)."""
        self.registrations: dict[WorkerKey, Registration] = {}
        """Every registered rank as registered (a NATS worker's endpoint is its relay's): the registry that
        front 0 hands the other fronts."""
        self.fronts: Fronts | None = Fronts(self, front) if config.fronts > 1 else None
        self._routes = Routes(self)  # the HTTP API (routes.py)
        self.lane: Lane | None = None
        """The hot routes' HTTP (lane.py), while the service listens."""
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._routes.middleware])
        self.partitions: dict[tuple[str, str], Partition] = {}
        self.counters = ServiceCounters()
        self.accuracy = Accuracy(self.counters, lambda kind, fields: self._event(kind, **fields))
        self.trust = Trust(self.counters, lambda kind, fields: self._event(kind, **fields))
        """Each worker's trust state and the misconfigurations found (trust.py), updated by the health loop."""
        self.shadows = Shadows(config.shadow_policies, self.counters) if config.shadow_policies else None
        """``--shadow-policy``: other policies' choices on every decision, compared, never used (shadow.py)."""
        """Predicted against engine-reported reuse, per worker (``accuracy.py``)."""
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.decisions_ring)
        self.records = DecisionRecords()
        """Every decision with an id, kept to explain by id (``GET /decisions/{selection_id}``)."""
        self.decision_log: DecisionLog | None = (
            None if config.decision_log is None else DecisionLog(config.decision_log)
        )
        """``--decision-log FILE``: a line per decision (decisions.py)."""
        self.events: deque[dict[str, Any]] = deque(maxlen=config.events_ring)
        self.url = ""
        self._owner: dict[int, tuple[str, str]] = {}
        """instance_id -> its partition: ids are unique across partitions."""
        self._reservations: dict[str, _Reservation] = {}
        self._heard_late = False
        """A completion or free has waited for a peer's booking (:meth:`hear_of`): said once in the log."""
        self._decision_seq = 0
        self._event_seq = 0
        self.started_at = time.time()
        """When the service was built (``time.time()``): ``kvrouter top``'s uptime."""
        self.last_explained: dict[str, Any] | None = None
        """The most recent decisions-ring entry that carries its candidates (``explain``)."""
        self._explain_after = 0.0
        self._matched: list[tuple[WorkerKey, npt.NDArray[np.uint64], int]] = []
        """Decisions' (chosen worker, prompt local hashes, device overlap) since the last health tick, at most
        ``MATCHED_LIMIT``: fed to the index cap's order by ``feed_matches``."""
        """``perf_counter`` time after which the next decision is explained for the ring (``stats.py``)."""
        self.stats: StatsPublisher | None = None
        """The stats segment's publisher while the service serves (``stats.py``); None before and after."""
        self._discovery: Any = None
        self._forked = False
        self._started = False
        """The engine is up and the front's kernels are loaded: the routes that need them may run."""
        self._stopping = False
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._inflight = 0
        self._streams: dict[WorkerKey, WorkerStats] = {}
        self._index: dict[str, Any] = {"epoch": 0, "events_applied": 0, "last_event_age_ms": None, "recovering": 0}
        self._index_headers: dict[str, str] = {}
        self.health = Health(self)  # the health loop and /ready's answer (health.py)
        self._routes.add_to(self.app)
        metrics.install(self)
        self.fastpath: FastPath | None = fastpath.install(self)
        """The ZMQ fast path on ``config.zmq_port`` (None when off), bound and closed with the HTTP socket."""
        self.affinity = Affinity(config.session_affinity_ttl_secs)  # session affinity (affinity.py)
        proxy.install(self)  # POST /v1/completions (proxy.py)
        self.queue = RouterQueue(  # the router queue (queue.py)
            self, threshold=config.queue_threshold, policy=config.queue_policy, timeout_secs=config.queue_timeout_secs
        )
        self.sync: ReplicaSync | None = None
        """The replica sync over NATS (``kvrouter/bridge/``) when ``replica_sync`` is on."""
        if config.replica_sync:
            self.sync = ReplicaSync(
                config.nats_url,
                Subjects(config.namespace, config.component),
                self,
                expiry_secs=config.active_request_expiry_secs,
            )
        elif self.fronts is not None:  # the fronts of one machine, without NATS: the same sync on the local bus
            self.sync = ReplicaSync(
                self.fronts.endpoint,
                Subjects(config.namespace, config.component),
                self,
                expiry_secs=config.active_request_expiry_secs,
                connect=localbus.connect,
            )

        self.relay: NatsEventRelay | None = None
        """Workers registered with ``transport: nats``: their ``kv-events`` relayed onto local PUBs
        (``bridge/events.py``); made at the first such registration, on ``nats_url`` (at once in durable mode)."""
        self._relay_task: asyncio.Task[None] | None = None
        self.durable: DurableEvents | None = None
        """``durable_kv_events``: the JetStream consumer and snapshots feeding the relay (``bridge/durable.py``)."""
        if config.durable_kv_events and front is None:  # front 0 owns the engine, hence the relay
            subjects = Subjects(config.namespace, config.component)
            self.relay = NatsEventRelay(config.nats_url, subjects.kv_events, durable=True)
            self.durable = DurableEvents(
                self.relay,
                subjects,
                url=config.nats_url,
                consumer=consumer_name(config.router_id, config.host, config.port),
                snapshot_threshold=config.snapshot_threshold,
                reset_states=config.reset_states,
            )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Fork the engine's fork server: the one fork this process makes, so call it before any thread or
        event loop exists. Returns at once; :meth:`run` forks the appliers through it and waits for them
        (and for this process's own kernels to load or compile) off the event loop, so ``/health``
        answers from the first second while a cold numba cache compiles for minutes. Idempotent.

        Raises:
            EngineError: another engine runs in this process, or its segments are left behind.
        """
        if not self._forked and isinstance(self.engine, Engine):
            self.engine.start(wait=False)
        self._forked = True

    def _start_off_loop(self) -> asyncio.Future[None]:
        """:meth:`_finish_start` on a daemon thread of its own, not the loop's executor (which the loop joins
        when it closes): a compile cannot be interrupted, and a stop in the middle of one must not wait for
        it, so a stopped start is left to end (or be cut short by the exit) on its own."""
        loop = self._loop
        assert loop is not None
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

        def start() -> None:
            error: BaseException | None = None
            try:
                self._finish_start()
            except BaseException as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                loop.call_soon_threadsafe(settle, error)

        threading.Thread(target=start, name="kvrouter-start", daemon=True).start()
        return done

    def _finish_start(self) -> None:
        """On a worker thread: one decision and one query on throwaway state, so the front's kernels are
        compiled (or loaded from the cache) before ``/ready`` says so, then the appliers up.

        An engine's fork server compiles the appliers' kernels meanwhile, in its own processes: the front's
        go through a view of the engine's still empty shards, so both compile at once on a cold cache."""
        engine = self.engine
        if isinstance(engine, Engine):
            view = EngineView(engine.reader_handle())
            try:
                self._warm(view)
            finally:
                view.close()
            engine.finish_start()
        else:
            self._warm(engine)

    def _warm(self, index: Engine | EngineView) -> None:
        router = Router(self.config.router, block_size=16, seed=0)
        router.select(index, ((0, 0),), tokens=list(range(64)))
        fastparse.warm()
        index.find_matches([1, 2, 3])

    def stop(self) -> None:
        """Ask :meth:`run` to drain and return; safe from any thread or a signal handler, idempotent."""
        self._stop_requested = True
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(event.set)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def recorder(self) -> Recorder | None:
        """The ``--record`` writer (its counters for ``/metrics``); None when not recording."""
        return None if self.recording is None else self.recording.recorder

    @property
    def router_config(self) -> RouterConfig:
        """The weights and switches every partition's router applies."""
        return self.config.router

    async def run(
        self,
        *,
        on_ready: Callable[[str], None] | None = None,
        on_listening: Callable[[str], None] | None = None,
    ) -> None:
        """Bind (``on_listening(url)``: ``/health`` answers from here), bring the engine up off the loop,
        register ``config.workers`` (``on_ready(url)``), serve until :meth:`stop`; then turn ``/ready`` to
        503, drain the requests in flight (at most ``drain_secs``), close the sockets and the engine (which
        unlinks every segment). Forks first if :meth:`start` was not called (from a process whose loop
        runs: avoid).

        Raises:
            EngineError: the appliers did not come up (after the sockets and segments are closed).
        """
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        runner: web.AppRunner | None = None
        server: asyncio.Server | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            if not self._forked:
                log.warning("service run without start: forking the fork server from a running loop")
                self.start()
            if self.decision_log is not None:
                self.decision_log.open()  # after the fork: the appliers hold no handle on it
            if self.recording is not None:
                self.recording.open()  # after the fork too: its thread and socket are this process's
            fronts = self.fronts
            if fronts is not None and not fronts.primary:
                await fronts.open()  # the registry first: a front takes connections only once it can route
            runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=max(0.1, config.drain_secs))
            await runner.setup()
            assert runner.server is not None
            lane = self.lane = Lane(self._routes, runner.server)  # hot routes' own HTTP, aiohttp the rest (lane.py)
            if fronts is not None:
                lane.sharing = Sharing(lane)  # every front serves every connection (sharing.py)
            if fronts is not None and not fronts.primary:
                fronts.take_connections(lane)  # front 0 listens, and sends this front a copy of each (fronts.py)
                host, port = config.host, config.port
            else:
                server = await self._loop.create_server(lane, config.host, config.port, reuse_address=True)
                host, port = server.sockets[0].getsockname()[:2]
                if fronts is not None:
                    lane.deal = fronts.deal
            if fronts is not None and fronts.primary:
                await fronts.open()  # the local bus's broker, before the sync connects to it
            shown = f"[{host}]" if ":" in str(host) else str(host)
            self.url = f"http://{shown}:{port}"
            if not _loopback(config.host) and not config.auth_token:
                log.warning("service exposed without auth host=%s: write routes are open to the network", config.host)
            log.info("service listening url=%s shards=%d", self.url, config.shards)
            if on_listening is not None:
                on_listening(self.url)
            starting = self._start_off_loop()
            stopped = asyncio.ensure_future(self._stop_event.wait())
            await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stopped while starting: closing the engine ends a wait for the appliers
                stopped.cancel()
                self.engine.close()
                with contextlib.suppress(EngineError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(starting), ABANDON_START_S)
                return
            stopped.cancel()
            starting.result()  # raises EngineError when the appliers did not come up
            self._started = True
            self.health.refresh_index()
            self._event("engine started", shards=config.shards)
            for spec in config.workers:
                for rank in spec.dp_ranks:
                    self.register(
                        Registration(
                            instance_id=spec.worker_id,
                            endpoint=spec.event_endpoint(rank),
                            model_name=config.model_name,
                            block_size=spec.block_size,
                            dp_rank=rank,
                            routing_group=config.routing_group,
                            replay_endpoint=spec.replay_endpoint,
                            format=spec.format,
                            topic=spec.topic.decode(errors="replace"),
                            query_endpoint=spec.query_endpoint,
                        )
                    )
            self.health.open()
            tasks.append(asyncio.create_task(self.health.run(), name="kvrouter-health"))
            if self.sync is not None:
                tasks.append(asyncio.create_task(self.sync.run(), name="kvrouter-sync"))
            if self.durable is not None:
                tasks.append(asyncio.create_task(self.durable.run(), name="kvrouter-durable"))
            if fronts is not None and fronts.primary:
                await fronts.start_fronts(port)
            if isinstance(self.engine, Engine):  # front 0 speaks for the fronts to kvrouter top
                self._publish_stats(tasks)
            if self.decision_log is not None:
                tasks.append(asyncio.create_task(self.decision_log.run(), name="kvrouter-decision-log"))
            # What the start left (numba's kernels and type system, aiohttp, the rest: about 140,000 tracked
            # objects) lives as long as the process: frozen, a full collection no longer walks it. Walked, one
            # held the loop, and every request on it, for 55-80 ms (0.01 ms frozen; 16 workers registered).
            gc.freeze()
            if on_ready is not None:
                on_ready(self.url)
            await self._stop_event.wait()
            self._stopping = True
            if fronts is not None and fronts.primary:
                fronts.stop_others()  # every front drains at once, not one after the other
            self.queue.close()  # queue.py: waiters get 503
            self._event("stopping", inflight=self._inflight)
            deadline = time.monotonic() + config.drain_secs
            while self._inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            if self._inflight:
                log.warning("drain incomplete inflight=%d drain_secs=%s", self._inflight, config.drain_secs)
        finally:
            self._stopping = True
            if self.sync is not None:
                await self.sync.close()  # before its task is cancelled: queued events go out first
            if self._relay_task is not None:
                tasks.append(self._relay_task)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.health.close()
            if self.durable is not None:
                await self.durable.close()
            if self.relay is not None:
                await self.relay.close()
            if self.fronts is not None:
                await self.fronts.close()  # front 0: the other fronts drain and stop before the engine goes
            self._withdraw_stats()
            if self.decision_log is not None:
                self.decision_log.close()  # what the last second decided, written
            if server is not None:
                server.close()  # no new connection; the lane's are idle between requests
            if self.lane is not None:
                self.lane.close()
            if runner is not None:
                await runner.cleanup()  # aiohttp's connections: drained, then closed
            evicted = self._evicted() if self.recording is not None else 0
            self.engine.close()
            if self.recording is not None:
                self.recording.close(evicted)  # after the appliers: their last records are in
            log.info("service stopped url=%s", self.url)

    def _unanswered(self, partition: Partition) -> frozenset[int]:
        """The shards the decision just made could not read (none in approximate mode: no shard is asked)."""
        return frozenset() if partition.approx is not None else self.engine.unanswered()

    def _evicted(self) -> int:
        """Entries the index cap evicted so far, over every shard (0 when the engine cannot say)."""
        try:
            return sum(sum(shard.evicted.values()) for shard in self.engine.stats(workers=False))
        except EngineError:
            return 0

    def _publish_stats(self, tasks: list[asyncio.Task[None]]) -> None:
        """The stats segment and its 4 Hz task, then the discovery file (``kvrouter top``'s way in). A failure
        of either is logged and the service serves on without it: the dashboard is not the router."""
        publisher = StatsPublisher(self)
        try:
            publisher.open()
        except (OSError, KvRouterError) as exc:
            log.warning("stats segment not published name=%s error=%s", publisher.name, exc)
            publisher.close()
            return
        self.stats = publisher
        tasks.append(asyncio.create_task(publisher.run(), name="kvrouter-stats"))
        try:
            self._discovery = discovery.publish(
                url=self.url,
                control=self.engine.reader_handle().control_name,
                stats=publisher.name,
                started_at=self.started_at,
                model_name=self.config.model_name,
            )
        except OSError as exc:
            log.warning("discovery file not written dir=%s error=%s", discovery.runtime_dir(), exc)

    def _withdraw_stats(self) -> None:
        """Remove the discovery file, then the stats segment (a reader that found the file finds no segment
        and reports the router gone)."""
        path, self._discovery = self._discovery, None
        if path is not None:
            discovery.withdraw(path)
        publisher, self.stats = self.stats, None
        if publisher is not None:
            publisher.close()

    # -- partitions and workers -----------------------------------------------------------------

    def partition(self, model: str, group: str = "default") -> Partition:
        """The partition of (model, group).

        Raises:
            ServiceError: 404, no worker was ever registered under that model (or group).
        """
        partition = self.partitions.get((model, group))
        if partition is None:
            if any(m == model for m, _ in self.partitions):
                raise ServiceError(404, f"routing_group {group!r} of model {model!r} has no workers")
            raise ServiceError(404, f"model {model!r} has no workers")
        return partition

    def register(self, registration: Registration, *, follow: bool = True) -> None:
        """``POST /register``: add one (instance, dp_rank); the engine follows every rank known so far
        (``follow``; another front mirrors front 0's registration without it).

        Raises:
            ServiceError: 409 for a duplicate, a block-size mismatch in the partition, an id known in
                another partition or with another format; 400 for endpoints the engine cannot use.
        """
        recording = self.recording
        if recording is None:
            self._register(registration, follow=follow)
            return
        t = recording.clock.hold()  # a new partition's router reads the clock
        try:
            self._register(registration, follow=follow)
        finally:
            recording.clock.release()
        recording.registered(t, registration)

    def _register(self, registration: Registration, *, follow: bool) -> None:
        reg = registration
        key = (reg.model_name, reg.routing_group)
        rank_query: dict[int, str] = {}
        if follow and reg.transport == "nats" and self.config.router.use_kv_events:
            relay = self._relay()
            if self.durable is not None:
                if not self.durable.loaded:
                    raise ServiceError(503, "durable kv-events: still loading the snapshot and the stream; retry")
                try:
                    own = None if reg.query_endpoint is None else offset_endpoint(reg.query_endpoint, reg.dp_rank)
                except ConfigError as exc:
                    raise ServiceError(400, f"query_endpoint: {exc}") from exc
                rank_query[reg.dp_rank] = relay.add_query(reg.instance_id, reg.dp_rank, fallback=own)
            reg = replace(reg, endpoint=relay.add(reg.instance_id, reg.dp_rank))
        if self.config.router.use_kv_events and reg.endpoint is None:
            raise ServiceError(400, "endpoint: required (KV events are on)")
        owner = self._owner.get(reg.instance_id)
        if owner is not None and owner != key:
            raise ServiceError(409, f"instance {reg.instance_id} is registered in {owner[0]}:{owner[1]}")
        partition = self.partitions.get(key)
        if partition is not None and partition.block_size != reg.block_size:
            raise ServiceError(
                409, f"block_size {reg.block_size} differs from {partition.name}'s block_size {partition.block_size}"
            )
        instance = partition.instances.get(reg.instance_id) if partition else None
        if instance is not None:
            if reg.dp_rank in instance.ranks:
                raise ServiceError(409, f"instance {reg.instance_id} dp_rank {reg.dp_rank} is already registered")
            if instance.format != reg.format:
                raise ServiceError(409, f"instance {reg.instance_id} is registered with format {instance.format}")
        fresh = instance is None
        if instance is None:
            instance = Instance(reg.instance_id, reg.format)
        updated = Instance(
            reg.instance_id,
            reg.format,
            {**instance.ranks, reg.dp_rank: reg.endpoint or ""},
            replay_endpoint=instance.replay_endpoint if instance.ranks else reg.replay_endpoint,
            query_endpoint=instance.query_endpoint if instance.ranks else reg.query_endpoint,
            rank_queries={**instance.rank_queries, **rank_query},
            topic=instance.topic if instance.ranks else reg.topic,
            http_endpoint=reg.http_endpoint or instance.http_endpoint,
            total_kv_blocks=reg.total_kv_blocks or instance.total_kv_blocks,
        )
        if self.config.router.use_kv_events and follow:
            try:
                spec = updated.spec(reg.block_size)
            except ConfigError as exc:
                raise ServiceError(400, str(exc)) from exc
            try:
                self._owned_engine().add_worker(spec)
            except EngineError as exc:
                raise ServiceError(503, f"engine: {exc}") from exc
        if partition is None:
            recording = self.recording
            partition = Partition(
                reg.model_name,
                reg.routing_group,
                reg.block_size,
                self.config.router,
                expiry_secs=self.config.active_request_expiry_secs,
                seed=self.config.router_seed if recording is None else recording.seed,
                clock=time.monotonic if recording is None else recording.clock,
            )
            partition.trust = self.trust.states
            self.partitions[key] = partition
        partition.instances[reg.instance_id] = updated
        self._owner[reg.instance_id] = key
        self.registrations[reg.instance_id, reg.dp_rank] = reg
        self.trust.registered((reg.instance_id, reg.dp_rank))
        partition.rebuild()
        if self.sync is not None:
            self.sync.worker_registered((reg.instance_id, reg.dp_rank))  # peers' requests kept for it
        self.queue.changed(partition)  # queue.py
        self._event(
            "registered",
            model_name=reg.model_name,
            routing_group=reg.routing_group,
            worker_id=reg.instance_id,
            dp_rank=reg.dp_rank,
            endpoint=reg.endpoint,
            new_instance=fresh,
        )

    def _relay(self) -> NatsEventRelay:
        """The ``kv-events`` relay, made and started (on this loop) at its first use."""
        if self.relay is None:
            config = self.config
            subject = Subjects(config.namespace, config.component).kv_events
            self.relay = NatsEventRelay(config.nats_url, subject)
            self._relay_task = asyncio.get_running_loop().create_task(self.relay.run(), name="kvrouter-kv-events")
        return self.relay

    def unregister(self, request: Unregistration, *, follow: bool = True) -> int:
        """``POST /unregister``: remove a rank, or the whole instance; returns the ranks removed (the engine
        stops following them when ``follow``).

        Raises:
            ServiceError: 404, the instance is not registered there.
        """
        removed = 0
        for (model, group), partition in list(self.partitions.items()):
            if model != request.model_name or (request.routing_group not in (None, group)):
                continue
            instance = partition.instances.get(request.instance_id)
            if instance is None:
                continue
            if request.dp_rank is not None and request.dp_rank not in instance.ranks:
                raise ServiceError(404, f"instance {request.instance_id} has no dp_rank {request.dp_rank}")
            ranks = [request.dp_rank] if request.dp_rank is not None else list(instance.ranks)
            if self.relay is not None:
                self.relay.remove(request.instance_id, ranks)
            for rank in ranks:
                self.registrations.pop((request.instance_id, rank), None)
                self.accuracy.forget((request.instance_id, rank))
                self.trust.forget((request.instance_id, rank))
                del instance.ranks[rank]
                instance.rank_queries.pop(rank, None)
                partition.unhealthy.pop((request.instance_id, rank), None)
                self._streams.pop((request.instance_id, rank), None)
            removed += len(ranks)
            if self.config.router.use_kv_events and follow:
                engine = self._owned_engine()
                engine.remove_worker(request.instance_id)
                if instance.ranks:
                    engine.add_worker(instance.spec(partition.block_size))
            if partition.approx is not None:
                partition.approx.remove_worker(request.instance_id)  # a removed rank's blocks go with it
            if not instance.ranks:
                del partition.instances[request.instance_id]
                self._owner.pop(request.instance_id, None)
            partition.rebuild()
            self.queue.changed(partition)  # queue.py
            self._event(
                "unregistered", model_name=model, routing_group=group, worker_id=request.instance_id, dp_ranks=ranks
            )
        if not removed:
            raise ServiceError(404, f"instance {request.instance_id} is not registered under {request.model_name!r}")
        if self.recording is not None:
            self.recording.unregistered(time.monotonic_ns(), request)
        return removed

    def _owned_engine(self) -> Engine:
        """The engine, on the front that owns it (every registry change is made there: ``fronts.py``)."""
        assert isinstance(self.engine, Engine), "only front 0 changes what the engine follows"
        return self.engine

    def mirror_register(self, registration: Registration) -> None:
        """Another front: front 0 registered this rank (and its engine follows it); route to it here too."""
        try:
            self.register(registration, follow=False)
        except ServiceError as exc:  # front 0 accepted it: a refusal here is a bug, not the client's
            log.error("front registry out of step: register refused worker=%d error=%s", registration.instance_id, exc)

    def mirror_unregister(self, registration: Registration) -> None:
        """Another front: front 0 unregistered this rank."""
        request = Unregistration(
            registration.instance_id, registration.model_name, registration.routing_group, registration.dp_rank
        )
        try:
            self.unregister(request, follow=False)
        except ServiceError as exc:
            log.error("front registry out of step: unregister refused worker=%d error=%s", request.instance_id, exc)

    async def control(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The write routes that change the registry (``register``, ``unregister``, ``busy``): done here, or,
        on a front other than front 0, by front 0 (``fronts.py``). Returns (status, answer).

        Raises:
            ServiceError: the refusal, with the route's status.
        """
        if self.fronts is not None and not self.fronts.primary:
            return await self.fronts.forward(op, body)
        return self.apply_control(op, body)

    def apply_control(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """:meth:`control`'s work on the front that owns the engine; the other fronts hear of the change.

        Raises:
            ServiceError: the refusal (400 for an unknown ``op``).
        """
        answer: tuple[int, dict[str, Any]]
        if op == "register":
            self.register(parse_registration(body, endpoint_required=self.config.router.use_kv_events))
            answer = 201, {"status": "ok"}
        elif op == "unregister":
            answer = 200, {"status": "ok", "removed_ranks": self.unregister(parse_unregistration(body))}
        elif op == "busy":
            answer = 200, self.set_thresholds(body)
        else:
            raise ServiceError(400, f"unknown control operation {op!r}")
        if self.fronts is not None:
            self.fronts.changed()
        return answer

    def set_thresholds(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /busy_threshold``: a partition's busy thresholds; returns them as ``GET`` shows them.

        Raises:
            ServiceError: 404 unknown partition, 400 a threshold that is not a number >= 0 (or null).
        """
        model = body.get("model_name", body.get("model", "default"))
        group = body.get("routing_group", "default")
        if not isinstance(model, str) or not isinstance(group, str):
            raise ServiceError(400, "model_name and routing_group must be strings")
        partition = self.partition(model, group)
        config = partition.router.config
        decode = body.get("active_decode_blocks_threshold", config.active_decode_blocks_threshold)
        prefill = body.get("active_prefill_tokens_threshold", config.active_prefill_tokens_threshold)
        if decode is not None and (isinstance(decode, bool) or not isinstance(decode, int | float) or decode < 0):
            raise ServiceError(400, f"active_decode_blocks_threshold: expected a number >= 0 or null, got {decode!r}")
        if prefill is not None and (type(prefill) is not int or prefill < 0):
            raise ServiceError(
                400, f"active_prefill_tokens_threshold: expected an integer >= 0 or null, got {prefill!r}"
            )
        recording = self.recording
        t = 0 if recording is None else recording.clock.hold()  # the new router reads the clock
        try:
            partition.set_thresholds(decode=None if decode is None else float(decode), prefill=prefill)
        except ConfigError as exc:
            raise ServiceError(400, str(exc)) from exc
        finally:
            if recording is not None:
                recording.clock.release()
        if recording is not None:
            recording.thresholds(t, partition)
        thresholds = partition.thresholds()
        self._event("busy_threshold", **thresholds)
        self.queue.changed(partition)  # queue.py
        return thresholds

    # -- decisions ------------------------------------------------------------------------------

    def select(self, request: SelectRequest, *, reserve: bool) -> SelectResult:
        """``POST /select`` (``reserve=False``) and ``/select_and_reserve`` (``reserve=True``).

        Raises:
            ServiceError: 404 unknown model or group; 409 a ``selection_id`` already booked; 503 no
                schedulable worker; ``overload_status`` every worker over a busy threshold; 400 a prompt
                the hasher refuses.
        """
        recording = self.recording
        if recording is None:
            return self._select(request, reserve=reserve, t=0)
        t = recording.clock.hold()  # the router reads this one time throughout (recording.py)
        try:
            return self._select(request, reserve=reserve, t=t)
        finally:
            recording.clock.release()

    def _select(self, request: SelectRequest, *, reserve: bool, t: int) -> SelectResult:
        partition = self.partition(request.model_name, request.routing_group)
        candidates = partition.candidates
        if not candidates:
            self.counters.no_worker += 1
            skipped = len(partition.unhealthy)
            raise ServiceError(503, f"no schedulable worker in {partition.name} ({skipped} skipped as unhealthy)")
        block_size = partition.block_size
        local: npt.NDArray[np.uint64]
        hashing = time.perf_counter()
        if request.token_ids is not None:
            try:
                local = block_hashes_array(
                    request.token_ids, block_size, lora_name=request.lora_name, cache_namespace=request.cache_salt
                )
            except InvalidHashInput as exc:
                raise ServiceError(400, str(exc)) from exc
            isl = len(request.token_ids) if request.isl_tokens is None else request.isl_tokens
        else:
            local = np.array(request.block_hashes or (), dtype=np.uint64)
            isl = len(local) * block_size if request.isl_tokens is None else request.isl_tokens
        selection_id = request.selection_id
        if reserve:
            if selection_id is None:
                selection_id = uuid.uuid4().hex
            elif selection_id in self._reservations:
                raise ServiceError(409, f"selection_id {selection_id!r} is already reserved")
        explain = request.explain or request.fallbacks > 0 or request.probe
        # explained for the decisions ring only, one every EXPLAIN_INTERVAL_S (stats.py): kvrouter top always
        # has a recent decision's candidates, and requests that did not ask for them pay nothing
        sampled = not explain and hashing >= self._explain_after
        if sampled:
            self._explain_after = hashing + EXPLAIN_INTERVAL_S
        if request.probe and reserve:
            raise ServiceError(400, "probe: a probe books nothing; use /select")
        if not request.probe:
            candidates = self.affinity.candidates(partition.name, request.session_id, candidates)  # affinity.py
        router = partition.router
        index: Any = partition.approx if partition.approx is not None else self.engine
        shadowed = None
        if self.shadows is not None and not request.probe:  # before the live decision books anything
            shadowed = self.shadows.choose(partition, index, candidates, selection_id or "", local, isl)
        started = time.perf_counter()
        self.counters.phases["hash"].observe(started - hashing)
        recording = self.recording
        booked = selection_id if reserve else None
        try:
            selection = router.select(
                index,
                candidates,
                local_hashes=local,
                isl_tokens=isl,
                capacities=partition.capacities,
                request_id=booked,
                explain=explain or sampled,
                record=reserve
                or selection_id is not None
                or self.decision_log is not None
                or shadowed is not None
                or recording is not None,
            )
        except (NoWorkerAvailable, DuplicateRequest, EngineError) as exc:
            if recording is not None:
                kind = {NoWorkerAvailable: "overloaded", DuplicateRequest: "duplicate"}.get(type(exc), "engine")
                recording.decided(
                    t, partition, local, isl, request.lora_name, candidates, booked, request.probe, None, kind,
                    unanswered=self._unanswered(partition),
                )  # fmt: skip
            if isinstance(exc, NoWorkerAvailable):
                self.counters.overloaded += 1
                raise ServiceError(self.config.overload_status, f"overloaded: {exc}") from exc
            if isinstance(exc, DuplicateRequest):
                raise ServiceError(409, str(exc)) from exc
            raise ServiceError(503, f"engine: {exc}") from exc
        if recording is not None:
            recording.decided(
                t, partition, local, isl, request.lora_name, candidates, booked, request.probe, selection,
                unanswered=self._unanswered(partition),
            )  # fmt: skip
        elapsed = time.perf_counter() - started
        if request.probe:  # where it would go: nothing counted, recorded or bound
            instance = partition.instances[selection.worker[0]]
            return SelectResult(
                partition, selection, None, False, [], instance.http_endpoint, address(instance.http_endpoint)
            )
        self.affinity.bind(partition.name, request.session_id, selection.worker)  # affinity.py
        counters = self.counters
        counters.decision.observe(elapsed)
        counters.phases["decide"].observe(elapsed)
        counters.hit_rate.observe(selection.overlap_blocks / len(local) if len(local) else 0.0)
        counters.decisions += 1
        counters.selections[selection.worker] = counters.selections.get(selection.worker, 0) + 1
        counters.overlap_blocks += selection.overlap_blocks
        counters.prompt_blocks += len(local)
        if selection.overlap_blocks and partition.approx is None and len(self._matched) < MATCHED_LIMIT:
            self._matched.append((selection.worker, local, selection.overlap_blocks))  # for feed_matches
        if reserve:
            assert selection_id is not None
            counters.reservations += 1
            predicted = selection.overlap_blocks * partition.block_size
            self._reservations[selection_id] = _Reservation(partition, selection.worker, time.monotonic(), predicted)
            if self.sync is not None:
                self.sync.added(selection_id, partition.slots, request.lora_name)  # queued: no I/O here
        fallbacks: list[tuple[WorkerKey, float]] = []
        if request.fallbacks and selection.explanation is not None:
            others = [w for w in selection.explanation if not w.selected and not w.busy]
            others.sort(key=lambda w: w.cost.total)
            fallbacks = [(w.worker, w.cost.total) for w in others[: request.fallbacks]]
        instance = partition.instances[selection.worker[0]]
        result = SelectResult(
            partition,
            selection,
            selection_id,
            reserve,
            fallbacks,
            instance.http_endpoint,
            address(instance.http_endpoint),
        )
        record = selection.record
        if self.shadows is not None and shadowed is not None and record is not None:
            self.shadows.account(partition, *shadowed, selection.worker, record)
        self._record_decision(result, len(local), elapsed, shadowed[2] if shadowed is not None else None)
        if record is not None:
            recorded = Recorded(
                selection_id or f"seq-{self._decision_seq}",
                self._decision_seq,
                time.time(),
                partition.model_name,
                partition.routing_group,
                block_size,
                isl,
                reserve,
                record,
            )
            if selection_id is not None:
                self.records.add(recorded)
            if self.decision_log is not None:
                self.decision_log.add(recorded)
        if sampled:  # the answer is the one an unexplained request gets
            selection.explanation = None
        return result

    def prefill_complete(self, selection_id: str, cached_tokens: int | None = None) -> None:
        """The reservation's first token is out: its prompt stops counting as queued prefill. ``cached_tokens``:
        the prompt tokens the engine reused, when the client knows them (:meth:`report_reuse`).

        Raises:
            ServiceError: 404, no such reservation.
        """
        if cached_tokens is not None:
            self.report_reuse(selection_id, cached_tokens)
        reservation = self._reservations.get(selection_id)
        if reservation is None:
            peer = self._peer_reservation(selection_id)
            if peer is None:
                raise ServiceError(404, f"reservation {selection_id!r} not found")
            reservation = peer
        recording = self.recording
        if recording is None:
            reservation.partition.slots.mark_prefill_completed(selection_id)
        else:
            t = recording.clock.hold()
            try:
                reservation.partition.slots.mark_prefill_completed(selection_id)
            finally:
                recording.clock.release()
            recording.booked("pc", t, selection_id)
        if self.sync is not None:
            self.sync.prefill_completed(selection_id, reservation.worker)
        self.queue.changed(reservation.partition)  # queue.py

    def free(self, selection_id: str) -> None:
        """The reservation's request ended: take its load back.

        Raises:
            ServiceError: 404, no such reservation (never booked, already freed or expired).
        """
        reservation = self._reservations.pop(selection_id, None)
        if reservation is None:
            reservation = self._peer_reservation(selection_id)
            if reservation is None:
                raise ServiceError(404, f"reservation {selection_id!r} not found")
        self.free_booked(reservation.partition, selection_id)
        if self.sync is not None:
            self.sync.freed(selection_id, reservation.worker)
        self.queue.changed(reservation.partition)  # queue.py

    def free_booked(self, partition: Partition, selection_id: str) -> None:
        """Take a reservation's load off its partition's slot manager (recorded when recording)."""
        recording = self.recording
        if recording is None:
            partition.slots.free(selection_id)
            return
        t = recording.clock.hold()
        try:
            partition.slots.free(selection_id)
        finally:
            recording.clock.release()
        recording.booked("free", t, selection_id)

    def sweep(self, partition: Partition) -> bool:
        """The slot manager's sweep of requests past their expiry (the health loop's; recorded when recording).
        Returns whether it removed any."""
        recording = self.recording
        if recording is None:
            return bool(partition.slots.sweep())
        t = recording.clock.hold()
        try:
            removed = bool(partition.slots.sweep())
        finally:
            recording.clock.release()
        if removed:
            recording.swept(t, partition)
        return removed

    def report_reuse(self, selection_id: str, cached_tokens: int) -> str | None:
        """The engine reused ``cached_tokens`` of the reservation's prompt: compare with the prediction
        (``accuracy.py``). Returns the outcome, or None when there is nothing to compare with (not booked
        here, already reported, or freed)."""
        reservation = self._reservations.get(selection_id)
        if reservation is None or reservation.predicted is None or reservation.reported:
            return None
        reservation.reported = True
        block_size = reservation.partition.block_size
        return self.accuracy.observe(reservation.worker, reservation.predicted, cached_tokens, block_size)

    def knows_reservation(self, selection_id: str) -> bool:
        """Booked here, or by a peer and applied here (:meth:`_peer_reservation`)."""
        return selection_id in self._reservations or self._peer_reservation(selection_id) is not None

    def awaits_booking(self, selection_id: str) -> bool:
        """A completion or free of this reservation would wait in :meth:`hear_of`: replica sync is connected
        and the reservation is not known here (yet)."""
        sync = self.sync
        return sync is not None and sync.connected and not self.knows_reservation(selection_id)

    async def hear_of(self, selection_id: str) -> None:
        """Before completing or freeing a reservation not known here: with replica sync connected, wait up to
        :data:`SYNC_GRACE_S` for a peer's booking of it to arrive (then the call applies as usual, or answers
        404 as before). A call for a reservation known here, or with no sync or no connection, goes on at once."""
        if not self.awaits_booking(selection_id):
            return
        started = time.monotonic()
        while time.monotonic() - started < SYNC_GRACE_S and not self._stopping:
            await asyncio.sleep(SYNC_POLL_S)
            if self.knows_reservation(selection_id):
                if not self._heard_late:
                    self._heard_late = True
                    log.info(
                        "reservation heard of late selection_id=%s waited_ms=%.0f: a call reached this replica "
                        "before the peer's booking did (a balancer that is not sticky); waited (logged once)",
                        selection_id,
                        (time.monotonic() - started) * 1000,
                    )
                return

    def _peer_reservation(self, selection_id: str) -> _Reservation | None:
        """A reservation another replica booked and the sync applied here: with replica sync on, any
        replica may complete or free any reservation (a load balancer need not be sticky)."""
        if self.sync is None:
            return None
        for partition in self.partitions.values():
            booked = partition.slots.booked(selection_id)
            if booked is not None:
                return _Reservation(partition, booked.worker, time.monotonic())
        return None

    # -- the replica sync's host (bridge/sync.py SyncHost) ----------------------------------------

    def slots_of(self, worker: WorkerKey) -> SlotManager | None:
        """The slot manager of the registered worker's partition; None when not registered."""
        owner = self._owner.get(worker[0])
        if owner is None:
            return None
        partition = self.partitions[owner]
        instance = partition.instances.get(worker[0])
        if instance is None or worker[1] not in instance.ranks:
            return None
        return partition.slots

    def all_slots(self) -> Iterator[SlotManager]:
        return (partition.slots for partition in self.partitions.values())

    def own_requests(self) -> Collection[str]:
        """The reservations this replica booked and still holds (a re-sync announces them to peers)."""
        return self._reservations.keys()

    def synced(self, worker: WorkerKey, request_id: str, kind: str) -> None:
        """A peer changed ``worker``'s load: waiters may fit now; a peer's Free of one of ours ends ours."""
        if kind == "Free":
            self._reservations.pop(request_id, None)
        owner = self._owner.get(worker[0])
        if owner is not None:
            self.queue.changed(self.partitions[owner])  # queue.py

    async def select_or_wait(
        self, request: SelectRequest, *, reserve: bool, gone: Callable[[], bool] | None = None
    ) -> SelectResult:
        """:meth:`select`, or wait in the router queue (``queue.py``) when every worker is busy and
        ``queue_threshold`` is set; ``gone()`` tells whether the client left meanwhile."""
        return await self.queue.select(request, reserve=reserve, gone=gone)

    def pending(self, model: str, group: str) -> tuple[int, int]:
        """(pending_count, pending_isl_tokens) of the partition's router queue."""
        return self.queue.pending(model, group)

    async def decision(self, selection_id: str) -> dict[str, Any] | None:
        """``GET /decisions/{selection_id}``: the decision as it was made, from this front's ring or, with
        ``--fronts N``, another front's; None when no front keeps it."""
        recorded = self.records.get(selection_id)
        if recorded is not None:
            return decision_json(recorded)
        if self.fronts is not None:
            return await self.fronts.find_decision(selection_id)
        return None

    def fleet_counters(self) -> ServiceCounters:
        """The counters ``/metrics`` and ``kvrouter top`` show: this front's, or with ``--fronts N`` every
        front's summed (``fronts.py``)."""
        return self.counters if self.fronts is None else self.fronts.counters()

    def reservations(self) -> int:
        """Reservations currently booked."""
        return len(self._reservations)

    def _record_decision(
        self, result: SelectResult, prompt_blocks: int, elapsed: float, shadows: list[ShadowChoice] | None = None
    ) -> None:
        self._decision_seq += 1
        selection = result.selection
        entry: dict[str, Any] = {
            "seq": self._decision_seq,
            "at": time.time(),
            "model_name": result.partition.model_name,
            "routing_group": result.partition.routing_group,
            "worker_id": selection.worker[0],
            "dp_rank": selection.worker[1],
            "overlap_blocks": selection.overlap_blocks,
            "prompt_blocks": prompt_blocks,
            "isl_tokens": selection.isl_tokens,
            "cost": selection.cost.total,
            "reserved": result.reserved,
            "selection_id": result.selection_id,
            "decision_us": round(elapsed * 1e6, 1),
        }
        if shadows is not None:
            entry["shadows"] = {
                c.policy: {
                    "worker_id": c.worker[0],
                    "dp_rank": c.worker[1],
                    "overlap_blocks": c.overlap_blocks,
                    "cost": c.cost,
                }
                for c in shadows
            }
        if selection.explanation is not None:
            entry["explain"] = explain(result)["workers"]
            self.last_explained = entry
        self.decisions.append(entry)

    # -- events, readiness, index queries -------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> None:
        self._event_seq += 1
        self.events.append({"seq": self._event_seq, "at": time.time(), "kind": kind, **fields})

    async def feed_matches(self) -> None:
        """Send the blocks the decisions since the last call matched to their workers' appliers, one message
        per worker (the health loop calls it on every tick): the "matched" half of the index cap's least
        recently used order. Off the decision path, which only appends one tuple; the chains are hashed
        here, ``FEED_SLICE`` prompts at a time with the loop let go between slices: done at once, a tick's
        feeding held every request behind it for about 2 ms twice a second, which was most of
        ``bench_service``'s p99 at concurrency 8. A worker's chains go as they are, repeats and all: the
        applier's ``touch`` counts a block once per message, and sorting them out here (``np.unique``,
        about 90 µs a worker) was two thirds of a tick's feeding on the loop. Another front of
        ``--fronts N`` sends them from its own process (``EngineView.touch``)."""
        matched, self._matched = self._matched, []
        deepest: dict[tuple[WorkerKey, bytes], tuple[npt.NDArray[np.uint64], int]] = {}
        for worker, local, overlap in matched:  # a prompt matched again and again is hashed once, at its deepest
            key = (worker, local.tobytes())
            if overlap > deepest.get(key, (local, 0))[1]:
                deepest[key] = (local, overlap)
        by_worker: dict[WorkerKey, list[npt.NDArray[np.uint64]]] = {}
        for n, ((worker, _), (local, overlap)) in enumerate(deepest.items(), 1):
            by_worker.setdefault(worker, []).append(sequence_hashes_array(local[:overlap]))
            if n % FEED_SLICE == 0:
                await asyncio.sleep(0)
        for n, (worker, chains) in enumerate(by_worker.items(), 1):
            self.engine.touch(worker, np.concatenate(chains))
            if n % FEED_SLICE == 0:
                await asyncio.sleep(0)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /ready``'s answer: ready only with every shard up, nothing recovering, a schedulable
        worker, and not stopping."""
        return self.health.ready()

    def _tiers(self, partition: Partition, local: npt.NDArray[np.uint64]) -> dict[StorageTier, dict[WorkerKey, int]]:
        if partition.approx is not None:
            return partition.approx.find_matches_by_tier(local.tolist())
        try:
            return self.engine.find_matches_by_tier(local)  # type: ignore[arg-type]  # takes the array as is
        except EngineError as exc:
            raise ServiceError(503, f"engine: {exc}") from exc

    def _query(self, partition: Partition, local: npt.NDArray[np.uint64]) -> dict[str, Any]:
        """The indexer's answer in matched tokens: ``scores`` (device, legacy) and ``instances``."""
        tiers = self._tiers(partition, local)
        block = partition.block_size
        scores: dict[str, dict[str, int]] = {}
        instances: dict[str, dict[str, Any]] = {}
        for key in partition.worker_keys():
            device, host, disk, shared = (tiers.get(tier, {}).get(key, 0) for tier in StorageTier)
            deepest = max(device, host, disk, shared)
            if not deepest:
                continue
            wid, rank = str(key[0]), str(key[1])
            if device:
                scores.setdefault(wid, {})[rank] = device * block
            entry = instances.setdefault(wid, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
            entry["dp"][rank] = device * block
            entry["gpu"] = max(entry["gpu"], device * block)
            entry["cpu"] = max(entry["cpu"], max(device, host) * block)
            entry["disk"] = max(entry["disk"], max(device, host, disk) * block)
            entry["longest_matched"] = max(entry["longest_matched"], deepest * block)
        return {"scores": scores, "frequencies": [], "instances": instances}
