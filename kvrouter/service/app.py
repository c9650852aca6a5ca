"""``Service``: the router front: one asyncio loop serving the HTTP API over one shared-memory engine.

The process layout is ``kvrouter up``'s (``plan``, ``spec/interfaces.md`` §2): this process owns one
:class:`~kvrouter.engine.Engine` (its appliers are forked, before the loop starts, by
:meth:`Service.start`) and answers every request on one event loop. Every route is a few microseconds
of synchronous work (parse, hash, one index read through shared memory, one compiled decision), so one
loop with no locks is both the simplest and the fastest layout: a thread pool would add a hand-off per
request and a lock around every router, and gain nothing on two cores. Partitions (``partition.py``)
hold the per-(model, routing group) state; this module holds the routes, the health loop and the
lifecycle.

Health is refreshed off the request path, every ``health_interval_secs``: shard status, each worker's
stream (stale, gaps, restarts) and the answer of its ``http_endpoint``. A change rebuilds the
partition's candidate tuple, lands in the events ring (``GET /events``) and in the cached index summary
that every JSON answer carries (``index`` object and ``X-Kvrouter-Index-*`` headers), so ``/select``
never reads the control segment itself.

A worker whose events went stale is skipped only while it has requests booked: engines publish only
when their cache changes, so an idle worker is quiet, and skipping every quiet worker would starve it
for ever (it could never receive the request that would make it speak again). Booked requests and
silence together mean its stream is broken. A worker whose ``http_endpoint`` stops answering is skipped
until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt
import orjson
from aiohttp import ClientSession, ClientTimeout, hdrs, web
from multidict import CIMultiDict

from ..engine import Engine, WorkerStats
from ..errors import (
    ConfigError,
    DuplicateRequest,
    EngineError,
    InvalidHashInput,
    KvRouterError,
    NoWorkerAvailable,
    ServiceError,
)
from ..events.codecs.dynamo import Encoder
from ..events.model import StorageTier, WorkerKey
from ..hashing import block_hashes_array
from ..routing.router import Router, Selection
from ..routing.slots import DEFAULT_EXPIRY_SECS
from . import fastparse, fastpath, metrics, proxy
from .affinity import Affinity
from .config import ServiceConfig
from .fastpath import FastPath
from .histogram import HIT_RATE_BUCKETS, Buckets
from .partition import Instance, Partition
from .queue import RouterQueue, client_gone
from .validation import (
    MAX_ID,
    Registration,
    SelectRequest,
    Unregistration,
    parse_body,
    parse_query,
    parse_registration,
    parse_select,
    parse_unregistration,
)

__all__ = ["PHASES", "SelectResult", "Service", "ServiceCounters"]

log = logging.getLogger(__name__)

SESSION_HEADER: Final = "X-Dynamo-Session-ID"
"""The reference's session header (``--router-session-affinity-ttl-secs``); a body's ``session_id`` wins."""
PHASES: Final = ("parse", "hash", "decide", "serialise", "total")
"""Where a ``/select``'s time goes (``ServiceCounters.phases``): the body read, decoded and validated; the
tokens hashed to blocks; the decision (``Router.select``: index walk, costs, choice); the answer built
and encoded; and the whole handler."""
PROBE_EVERY: Final = 4
"""``http_endpoint`` probes run every this many health ticks."""
PROBE_TIMEOUT_S: Final = 1.0
OPEN_ROUTES: Final = frozenset({"/query", "/query_by_hash", "/select"})
"""POST routes that only read (no state changes): open even with an auth token. Every other POST and
DELETE is a write and needs the bearer token when one is set."""
ALWAYS_SERVED: Final = frozenset({"/health", "/ready", "/metrics"})
"""Routes still answered while the service drains."""
NS: Final = 1_000_000_000
JSON: Final = "application/json"
HEADS_CACHED: Final = 4096
"""``/select`` answer heads kept (one per partition, worker and endpoint); cleared when full."""


@dataclass(slots=True)
class ServiceCounters:
    """What the service counts, read at scrape time by ``metrics.py``. Mutated by the event loop only."""

    decisions: int = 0
    reservations: int = 0
    """``/select_and_reserve`` decisions."""
    selections: dict[WorkerKey, int] = field(default_factory=dict)
    """Decisions per chosen (worker_id, dp_rank)."""
    overlap_blocks: int = 0
    """Sum over decisions of the chosen worker's device overlap in blocks."""
    prompt_blocks: int = 0
    """Sum over decisions of the prompt's full blocks: ``overlap_blocks / prompt_blocks`` is the hit rate."""
    overloaded: int = 0
    """Requests refused because every candidate was over a busy threshold."""
    no_worker: int = 0
    """Requests refused because the partition had no schedulable worker."""
    expired_reservations: int = 0
    decision: Buckets = field(default_factory=Buckets)
    """Seconds per decision (``Router.select``)."""
    hit_rate: Buckets = field(default_factory=lambda: Buckets(HIT_RATE_BUCKETS))
    """Per decision, the chosen worker's predicted overlap over the prompt's blocks."""
    phases: dict[str, Buckets] = field(default_factory=lambda: {phase: Buckets() for phase in PHASES})
    """Seconds per phase of a ``/select`` (``PHASES``)."""
    http_requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(route, method) -> requests."""
    http_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    """(route, "4xx" | "5xx") -> answers."""
    http_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    """(route, method) -> total seconds spent answering."""


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


def _address(http_endpoint: str | None) -> str | None:
    """``ip:port`` of an ``http://ip:port/...`` endpoint: GIE's ``x-gateway-destination-endpoint`` form."""
    if not http_endpoint:
        return None
    parts = urlsplit(http_endpoint)
    if parts.hostname is None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status=status, content_type=JSON, headers=headers
    )


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


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

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.engine = Engine(shards=config.shards, plane=config.plane)
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._middleware])
        self.partitions: dict[tuple[str, str], Partition] = {}
        self.counters = ServiceCounters()
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.decisions_ring)
        self.events: deque[dict[str, Any]] = deque(maxlen=config.events_ring)
        self.url = ""
        self._owner: dict[int, tuple[str, str]] = {}
        """instance_id -> its partition: ids are unique across partitions."""
        self._reservations: dict[str, _Reservation] = {}
        self._decision_seq = 0
        self._event_seq = 0
        self._forked = False
        self._started = False
        """The engine is up and the front's kernels are loaded: the routes that need them may run."""
        self._stopping = False
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._inflight = 0
        self._shard_status: dict[int, str] = {}
        self._shard_restarts: dict[int, int] = {}
        self._streams: dict[WorkerKey, WorkerStats] = {}
        self._index: dict[str, Any] = {"epoch": 0, "events_applied": 0, "last_event_age_ms": None, "recovering": 0}
        self._index_headers: dict[str, str] = {}
        self._index_json: tuple[object, bytes] = (None, b"")
        """(the ``_index`` dict it encodes, its JSON): re-encoded when ``_refresh_index`` swaps the dict."""
        self._json_headers: tuple[object, CIMultiDict[str]] = (None, CIMultiDict())
        """(the ``_index_headers`` they hold, those headers plus Content-Type), as ``_index_json``."""
        self._heads: dict[tuple[str, str, int, WorkerKey, str | None], bytes] = {}
        self._ticks = 0
        self._session: ClientSession | None = None
        self._add_routes()
        metrics.install(self)
        self.fastpath: FastPath | None = fastpath.install(self)
        """The ZMQ fast path on ``config.zmq_port`` (None when off), bound and closed with the HTTP socket."""
        self.affinity = Affinity(config.session_affinity_ttl_secs)  # session affinity (affinity.py)
        proxy.install(self)  # POST /v1/completions (proxy.py)
        self.queue = RouterQueue(  # the router queue (queue.py)
            self, threshold=config.queue_threshold, policy=config.queue_policy, timeout_secs=config.queue_timeout_secs
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
        if not self._forked:
            self.engine.start(wait=False)
            self._forked = True

    def _finish_start(self) -> None:
        """On a worker thread: the appliers up, then one decision and one query on throwaway state, so the
        front's kernels are compiled (or loaded from the cache) before ``/ready`` says so."""
        self.engine.finish_start()
        router = Router(self.config.router, block_size=16, seed=0)
        router.select(self.engine, ((0, 0),), tokens=list(range(64)))
        fastparse.warm()
        self.engine.find_matches([1, 2, 3])

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
        tasks: list[asyncio.Task[None]] = []
        try:
            if not self._forked:
                log.warning("service run without start: forking the fork server from a running loop")
                self.start()
            runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=max(0.1, config.drain_secs))
            await runner.setup()
            site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
            await site.start()
            host, port = runner.addresses[0][:2]
            shown = f"[{host}]" if ":" in str(host) else str(host)
            self.url = f"http://{shown}:{port}"
            if not _loopback(config.host) and not config.auth_token:
                log.warning("service exposed without auth host=%s: write routes are open to the network", config.host)
            log.info("service listening url=%s shards=%d", self.url, config.shards)
            if on_listening is not None:
                on_listening(self.url)
            starting = asyncio.ensure_future(self._loop.run_in_executor(None, self._finish_start))
            stopped = asyncio.ensure_future(self._stop_event.wait())
            await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stopped while starting: closing the engine ends the start
                stopped.cancel()
                self.engine.close()
                with contextlib.suppress(EngineError):
                    await starting
                return
            stopped.cancel()
            starting.result()  # raises EngineError when the appliers did not come up
            self._started = True
            self._refresh_index()
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
            self._session = ClientSession(timeout=ClientTimeout(total=PROBE_TIMEOUT_S))
            tasks.append(asyncio.create_task(self._health_loop(), name="kvrouter-health"))
            if on_ready is not None:
                on_ready(self.url)
            await self._stop_event.wait()
            self._stopping = True
            self.queue.close()  # queue.py: waiters get 503
            self._event("stopping", inflight=self._inflight)
            deadline = time.monotonic() + config.drain_secs
            while self._inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            if self._inflight:
                log.warning("drain incomplete inflight=%d drain_secs=%s", self._inflight, config.drain_secs)
        finally:
            self._stopping = True
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._session is not None:
                await self._session.close()
            if runner is not None:
                await runner.cleanup()
            self.engine.close()
            log.info("service stopped url=%s", self.url)

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

    def register(self, registration: Registration) -> None:
        """``POST /register``: add one (instance, dp_rank); the engine follows every rank known so far.

        Raises:
            ServiceError: 409 for a duplicate, a block-size mismatch in the partition, an id known in
                another partition or with another format; 400 for endpoints the engine cannot use.
        """
        reg = registration
        key = (reg.model_name, reg.routing_group)
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
            topic=instance.topic if instance.ranks else reg.topic,
            http_endpoint=reg.http_endpoint or instance.http_endpoint,
            total_kv_blocks=reg.total_kv_blocks or instance.total_kv_blocks,
        )
        if self.config.router.use_kv_events:
            try:
                spec = updated.spec(reg.block_size)
            except ConfigError as exc:
                raise ServiceError(400, str(exc)) from exc
            try:
                self.engine.add_worker(spec)
            except EngineError as exc:
                raise ServiceError(503, f"engine: {exc}") from exc
        if partition is None:
            partition = Partition(reg.model_name, reg.routing_group, reg.block_size, self.config.router)
            self.partitions[key] = partition
        partition.instances[reg.instance_id] = updated
        self._owner[reg.instance_id] = key
        partition.rebuild()
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

    def unregister(self, request: Unregistration) -> int:
        """``POST /unregister``: remove a rank, or the whole instance; returns the ranks removed.

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
            for rank in ranks:
                del instance.ranks[rank]
                partition.unhealthy.pop((request.instance_id, rank), None)
                self._streams.pop((request.instance_id, rank), None)
            removed += len(ranks)
            if self.config.router.use_kv_events:
                self.engine.remove_worker(request.instance_id)
                if instance.ranks:
                    self.engine.add_worker(instance.spec(partition.block_size))
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
        return removed

    # -- decisions ------------------------------------------------------------------------------

    def select(self, request: SelectRequest, *, reserve: bool) -> SelectResult:
        """``POST /select`` (``reserve=False``) and ``/select_and_reserve`` (``reserve=True``).

        Raises:
            ServiceError: 404 unknown model or group; 409 a ``selection_id`` already booked; 503 no
                schedulable worker; ``overload_status`` every worker over a busy threshold; 400 a prompt
                the hasher refuses.
        """
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
        explain = request.explain or request.fallbacks > 0
        candidates = self.affinity.candidates(partition.name, request.session_id, candidates)  # affinity.py
        router = partition.router
        index: Any = partition.approx if partition.approx is not None else self.engine
        started = time.perf_counter()
        self.counters.phases["hash"].observe(started - hashing)
        try:
            selection = router.select(
                index,
                candidates,
                local_hashes=local,
                isl_tokens=isl,
                capacities=partition.capacities,
                request_id=selection_id if reserve else None,
                explain=explain,
            )
        except NoWorkerAvailable as exc:
            self.counters.overloaded += 1
            raise ServiceError(self.config.overload_status, f"overloaded: {exc}") from exc
        except DuplicateRequest as exc:
            raise ServiceError(409, str(exc)) from exc
        except EngineError as exc:
            raise ServiceError(503, f"engine: {exc}") from exc
        elapsed = time.perf_counter() - started
        self.affinity.bind(partition.name, request.session_id, selection.worker)  # affinity.py
        counters = self.counters
        counters.decision.observe(elapsed)
        counters.phases["decide"].observe(elapsed)
        counters.hit_rate.observe(selection.overlap_blocks / len(local) if len(local) else 0.0)
        counters.decisions += 1
        counters.selections[selection.worker] = counters.selections.get(selection.worker, 0) + 1
        counters.overlap_blocks += selection.overlap_blocks
        counters.prompt_blocks += len(local)
        if reserve:
            assert selection_id is not None
            counters.reservations += 1
            self._reservations[selection_id] = _Reservation(partition, selection.worker, time.monotonic())
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
            _address(instance.http_endpoint),
        )
        self._record_decision(result, len(local), elapsed)
        return result

    def prefill_complete(self, selection_id: str) -> None:
        """The reservation's first token is out: its prompt stops counting as queued prefill.

        Raises:
            ServiceError: 404, no such reservation.
        """
        reservation = self._reservations.get(selection_id)
        if reservation is None:
            raise ServiceError(404, f"reservation {selection_id!r} not found")
        reservation.partition.slots.mark_prefill_completed(selection_id)
        self.queue.changed(reservation.partition)  # queue.py

    def free(self, selection_id: str) -> None:
        """The reservation's request ended: take its load back.

        Raises:
            ServiceError: 404, no such reservation (never booked, already freed or expired).
        """
        reservation = self._reservations.pop(selection_id, None)
        if reservation is None:
            raise ServiceError(404, f"reservation {selection_id!r} not found")
        reservation.partition.slots.free(selection_id)
        self.queue.changed(reservation.partition)  # queue.py

    async def select_or_wait(
        self, request: SelectRequest, *, reserve: bool, gone: Callable[[], bool] | None = None
    ) -> SelectResult:
        """:meth:`select`, or wait in the router queue (``queue.py``) when every worker is busy and
        ``queue_threshold`` is set; ``gone()`` tells whether the client left meanwhile."""
        return await self.queue.select(request, reserve=reserve, gone=gone)

    def pending(self, model: str, group: str) -> tuple[int, int]:
        """(pending_count, pending_isl_tokens) of the partition's router queue."""
        return self.queue.pending(model, group)

    def reservations(self) -> int:
        """Reservations currently booked."""
        return len(self._reservations)

    def _record_decision(self, result: SelectResult, prompt_blocks: int, elapsed: float) -> None:
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
        if selection.explanation is not None:
            entry["explain"] = self._explain(result)["workers"]
        self.decisions.append(entry)

    # -- health ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> None:
        self._event_seq += 1
        self.events.append({"seq": self._event_seq, "at": time.time(), "kind": kind, **fields})

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_secs)
            try:
                self._tick()
                self._ticks += 1
                if self._ticks % PROBE_EVERY == 0:
                    await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything; log with the traceback
                log.exception("health tick failed")

    def _tick(self) -> None:
        """Shard status, stream health and gaps, candidate tuples, index summary, reservation expiry."""
        if not self._started or self._stopping:
            return
        self._refresh_index()
        streams = self.engine.workers() if self.config.router.use_kv_events else {}
        for key, stats in streams.items():
            before = self._streams.get(key)
            if before is not None:
                for name in ("gaps_detected", "gaps_recovered", "gaps_lost", "restarts"):
                    grown = getattr(stats, name) - getattr(before, name)
                    if grown > 0:
                        self._event(name, worker_id=key[0], dp_rank=key[1], count=grown, state=stats.state)
            self._streams[key] = stats
        for partition in self.partitions.values():
            unhealthy: dict[WorkerKey, str] = {}
            for instance in partition.instances.values():
                for rank in instance.ranks:
                    key = (instance.instance_id, rank)
                    row = streams.get(key)
                    if not instance.http_ok:
                        unhealthy[key] = "http_endpoint down"
                    elif row is not None and row.stale and partition.slots.active_requests(key) > 0:
                        unhealthy[key] = "events stale"
            if unhealthy != partition.unhealthy:
                for key in unhealthy.keys() - partition.unhealthy.keys():
                    self._event("skipped", worker_id=key[0], dp_rank=key[1], reason=unhealthy[key])
                for key in partition.unhealthy.keys() - unhealthy.keys():
                    self._event("recovered", worker_id=key[0], dp_rank=key[1])
                partition.unhealthy = unhealthy
                partition.rebuild()
        expiry = time.monotonic() - DEFAULT_EXPIRY_SECS
        for selection_id, reservation in list(self._reservations.items()):
            if reservation.at > expiry:
                break
            del self._reservations[selection_id]
            reservation.partition.slots.free(selection_id)
            self.counters.expired_reservations += 1
        self.queue.tick()  # queue.py: retry the waiters, drop those whose client left

    def _refresh_index(self) -> None:
        stats = self.engine.stats()
        for shard in stats:
            if self._shard_status.get(shard.shard) != shard.status:
                if shard.shard in self._shard_status:
                    self._event("shard", shard=shard.shard, status=shard.status, restarts=shard.restarts)
                self._shard_status[shard.shard] = shard.status
            self._shard_restarts[shard.shard] = shard.restarts
        last = max((s.last_event_ns for s in stats), default=0)
        self._index = {
            "epoch": sum(s.epoch for s in stats),
            "events_applied": sum(s.events_applied for s in stats),
            "last_event_age_ms": round((time.time_ns() - last) / 1e6, 1) if last else None,
            "recovering": sum(s.status == "recovering" for s in stats),
        }
        self._index_headers = {
            "X-Kvrouter-Index-Epoch": str(self._index["epoch"]),
            "X-Kvrouter-Index-Events": str(self._index["events_applied"]),
            "X-Kvrouter-Index-Age-Ms": str(self._index["last_event_age_ms"]),
        }

    async def _probe(self) -> None:
        """GET ``{http_endpoint}/health`` of every instance that has one; a failure marks it down."""
        session = self._session
        if session is None:
            return
        instances = [i for p in self.partitions.values() for i in p.instances.values() if i.http_endpoint]

        async def probe(instance: Instance) -> None:
            ok = False
            with contextlib.suppress(Exception):
                async with session.get(f"{instance.http_endpoint}/health") as response:
                    ok = response.status < 500
            instance.http_ok = ok

        await asyncio.gather(*(probe(i) for i in instances))

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /ready``'s answer: ready only with every shard up, nothing recovering, a schedulable
        worker, and not stopping."""
        reasons: list[str] = []
        shards: dict[str, str] = {}
        if self._stopping:
            reasons.append("stopping")
        if not self._started:
            reasons.append("engine starting")
        else:
            try:
                for shard in self.engine.stats():
                    shards[str(shard.shard)] = shard.status
                    if shard.status != "up":
                        reasons.append(f"shard {shard.shard} {shard.status}")
            except EngineError as exc:
                reasons.append(f"engine: {exc}")
        workers = [
            {"model_name": p.model_name, "routing_group": p.routing_group, "worker_id": k[0], "dp_rank": k[1]}
            for p in self.partitions.values()
            for k in p.candidates
        ]
        if not workers:
            reasons.append("no schedulable worker")
        ok = not reasons
        return ok, {
            "ready": ok,
            "schedulable_workers": len(workers),
            "workers": workers,
            "reasons": reasons,
            "shards": shards,
        }

    # -- HTTP -----------------------------------------------------------------------------------

    def _add_routes(self) -> None:
        r = self.app.router
        r.add_get("/health", self._h_health)
        r.add_get("/ready", self._h_ready)
        r.add_post("/register", self._h_register)
        r.add_post("/unregister", self._h_unregister)
        r.add_get("/workers", self._h_workers)
        r.add_post("/query", self._h_query)
        r.add_post("/query_by_hash", self._h_query_by_hash)
        r.add_post("/select", self._h_select)
        r.add_post("/select_and_reserve", self._h_select_and_reserve)
        r.add_post("/route", self._h_select_and_reserve)
        r.add_post("/reservations/{id}/prefill_complete", self._h_prefill_complete)
        r.add_delete("/reservations/{id}", self._h_free)
        r.add_get("/loads", self._h_loads)
        r.add_get("/dump", self._h_dump)
        r.add_get("/busy_threshold", self._h_busy_get)
        r.add_post("/busy_threshold", self._h_busy_set)
        r.add_get("/decisions", self._h_decisions)
        r.add_get("/events", self._h_events)

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        started = time.perf_counter()
        self._inflight += 1
        response: web.StreamResponse
        try:
            if self._stopping and name not in ALWAYS_SERVED:
                response = _error(503, "the service is stopping")
            elif (
                self.config.auth_token is not None
                and request.method in ("POST", "DELETE", "PUT", "PATCH")
                and name not in OPEN_ROUTES
                and not self._authorized(request)
            ):
                response = _error(401, "missing or wrong bearer token")
                response.headers["WWW-Authenticate"] = "Bearer"
            else:
                response = await handler(request)
        except ServiceError as exc:
            response = _error(exc.status, str(exc))
        except EngineError as exc:  # not up yet (see /ready), or closing
            response = _error(503, f"engine: {exc}")
        except web.HTTPException as exc:  # no such route (404), method (405), body too large (413)
            response = _error(exc.status, exc.reason if exc.status != 413 else exc.text or "body too large")
        except (KvRouterError, ValueError) as exc:
            response = _error(400, str(exc))
        except Exception as exc:
            log.exception("request failed route=%s kind=%s", name, type(exc).__name__)
            response = _error(500, f"internal error ({type(exc).__name__})")
        finally:
            self._inflight -= 1
        counters = self.counters
        key = (name, request.method)
        counters.http_requests[key] = counters.http_requests.get(key, 0) + 1
        counters.http_seconds[key] = counters.http_seconds.get(key, 0.0) + time.perf_counter() - started
        if response.status >= 400:
            klass = (name, "4xx" if response.status < 500 else "5xx")
            counters.http_errors[klass] = counters.http_errors.get(klass, 0) + 1
        return response

    def _authorized(self, request: web.Request) -> bool:
        token = self.config.auth_token
        assert token is not None
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_body(await request.read())

    def _with_index(self, body: dict[str, Any], status: int = 200) -> web.Response:
        body["index"] = self._index
        return _json(body, status, self._index_headers)

    async def _h_health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "stopping": self._stopping})

    async def _h_ready(self, request: web.Request) -> web.Response:
        ok, body = self.ready()
        return _json(body, 200 if ok else 503)

    async def _h_register(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.register(parse_registration(body, endpoint_required=self.config.router.use_kv_events))
        return _json({"status": "ok"}, 201)

    async def _h_unregister(self, request: web.Request) -> web.Response:
        removed = self.unregister(parse_unregistration(await self._body(request)))
        return _json({"status": "ok", "removed_ranks": removed})

    async def _h_workers(self, request: web.Request) -> web.Response:
        model = request.query.get("model_name")
        group = request.query.get("routing_group")
        out = []
        for partition in self.partitions.values():
            if model not in (None, partition.model_name) or group not in (None, partition.routing_group):
                continue
            for instance in partition.instances.values():
                out.append(self._worker_json(partition, instance))
        return _json(out, headers=self._index_headers)

    def _worker_json(self, partition: Partition, instance: Instance) -> dict[str, Any]:
        listeners: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for rank, endpoint in sorted(instance.ranks.items()):
            key = (instance.instance_id, rank)
            stats = self._streams.get(key)
            if key in partition.unhealthy:
                skipped[str(rank)] = partition.unhealthy[key]
            if partition.approx is not None:
                listeners[str(rank)] = {"endpoint": endpoint, "status": "approximate"}
                continue
            if stats is None:
                listeners[str(rank)] = {"endpoint": endpoint, "status": "pending"}
                continue
            listeners[str(rank)] = {
                "endpoint": endpoint,
                "status": "active" if stats.state in ("exact", "partial") else "pending",
                "state": stats.state,
                "stale": stats.stale,
                "cached_blocks": stats.cached_blocks,
                "last_id": stats.last_id,
                "gaps_detected": stats.gaps_detected,
                "gaps_recovered": stats.gaps_recovered,
                "gaps_lost": stats.gaps_lost,
                "restarts": stats.restarts,
                "events": stats.events,
            }
        status = "active"
        if skipped:
            status = "unhealthy" if len(skipped) == len(instance.ranks) else "degraded"
        return {
            "instance_id": instance.instance_id,
            "source": "zmq" if partition.approx is None else "approximate",
            "status": status,
            "model_name": partition.model_name,
            "routing_group": partition.routing_group,
            "block_size": partition.block_size,
            "format": instance.format,
            "endpoints": {str(rank): ep for rank, ep in sorted(instance.ranks.items())},
            "replay_endpoint": instance.replay_endpoint,
            "http_endpoint": instance.http_endpoint,
            "address": _address(instance.http_endpoint),
            "listeners": listeners,
            "skipped": skipped,
        }

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

    async def _h_query(self, request: web.Request) -> web.Response:
        query = parse_query(await self._body(request), by_hash=False)
        partition = self.partition(query.model_name, query.routing_group)
        assert query.token_ids is not None
        local = block_hashes_array(
            query.token_ids, partition.block_size, lora_name=query.lora_name, cache_namespace=query.cache_salt
        )
        return self._with_index(self._query(partition, local))

    async def _h_query_by_hash(self, request: web.Request) -> web.Response:
        query = parse_query(await self._body(request), by_hash=True)
        partition = self.partition(query.model_name, query.routing_group)
        local = np.array(query.block_hashes or (), dtype=np.uint64)
        return self._with_index(self._query(partition, local))

    def _explain(self, result: SelectResult) -> dict[str, Any]:
        config = result.partition.router.config
        explanation = result.selection.explanation or ()
        prompt_blocks = result.selection.isl_tokens // result.partition.block_size
        return {
            "weights": {
                "overlap_credit": config.overlap_score_credit,
                "prefill_load_scale": config.prefill_load_scale,
                "decode_active_request_weight": config.decode_active_request_weight,
                "prefill_work_weight": config.prefill_work_weight,
                "temperature": config.router_temperature,
                "policy": config.router_selection_policy,
            },
            "workers": [
                {
                    "worker_id": w.worker[0],
                    "dp_rank": w.worker[1],
                    "overlap_blocks": w.overlap.device,
                    "overlap": {
                        "device": w.overlap.device,
                        "host": w.overlap.host,
                        "disk": w.overlap.disk,
                        "shared": w.overlap.shared,
                    },
                    "prompt_blocks": prompt_blocks,
                    "raw_prefill_blocks": w.cost.raw_prefill_blocks,
                    "overlap_credit_blocks": w.cost.overlap_credit_blocks,
                    "adjusted_prefill_blocks": w.cost.adjusted_prefill_blocks,
                    "prefill_cost": w.cost.prefill_cost,
                    "decode_cost": w.cost.decode_blocks,
                    "request_cost": w.cost.request_cost,
                    "work_factor": w.cost.work_factor,
                    "cost": w.cost.total,
                    "prob": w.probability,
                    "selected": w.selected,
                    "busy": w.busy,
                }
                for w in explanation
            ],
        }

    def _select_json(self, result: SelectResult, request: SelectRequest) -> dict[str, Any]:
        selection = result.selection
        partition = result.partition
        block = partition.block_size
        wid, rank = selection.worker
        device = selection.overlap_blocks * block
        host = disk = device
        if selection.explanation is not None:
            for w in selection.explanation:
                if w.selected:
                    host, disk = (
                        max(w.overlap.host, w.overlap.device) * block,
                        max(w.overlap.disk, w.overlap.host) * block,
                    )
        body: dict[str, Any] = {
            "model_name": partition.model_name,
            "routing_group": partition.routing_group,
            "worker_id": wid,
            "dp_rank": rank,
            "endpoint": result.endpoint,
            "address": result.address,
            "block_size": block,
            "overlap": {
                "longest_matched": max(device, host, disk),
                "gpu": device,
                "dp": {str(rank): device},
                "cpu": host,
                "disk": disk,
            },
            "effective_prefill_tokens": max(0, selection.isl_tokens - device),
            "potential_decode_blocks": selection.cost.decode_blocks,
            "isl_tokens": selection.isl_tokens,
            "cost": selection.cost.total,
        }
        if result.selection_id is not None:
            body["selection_id"] = result.selection_id
        if request.fallbacks:
            body["fallbacks"] = [
                {
                    "worker_id": key[0],
                    "dp_rank": key[1],
                    "endpoint": (inst := partition.instances[key[0]]).http_endpoint,
                    "address": _address(inst.http_endpoint),
                    "cost": cost,
                }
                for key, cost in result.fallbacks
            ]
        if request.explain:
            body["explain"] = self._explain(result)
        return body

    def _select_head(self, partition: Partition, worker: WorkerKey, endpoint: str | None, address: str | None) -> bytes:
        """The answer's opening members up to ``"overlap":{"longest_matched":``, built once per
        (partition, worker, endpoint): everything in it is fixed by that key, so the cache needs no
        invalidation (it is only bounded)."""
        key = (partition.model_name, partition.routing_group, partition.block_size, worker, endpoint)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= HEADS_CACHED:
                self._heads.clear()
            opening = {
                "model_name": partition.model_name,
                "routing_group": partition.routing_group,
                "worker_id": worker[0],
                "dp_rank": worker[1],
                "endpoint": endpoint,
                "address": address,
                "block_size": partition.block_size,
            }
            head = orjson.dumps(opening)[:-1] + b',"overlap":{"longest_matched":'
            self._heads[key] = head
        return head

    def _select_response(self, result: SelectResult, request: SelectRequest) -> web.Response:
        """``/select``'s answer. The common case (no ``explain``, no ``fallbacks``) is spliced from
        preassembled bytes: the cached head, a few numbers, and the index summary encoded once per
        refresh; it is byte for byte what ``_select_json`` + ``orjson`` give (``test_api``), without the
        two nested dicts per request. The rest goes through ``_select_json``."""
        if request.explain or request.fallbacks or result.selection.explanation is not None:
            body = self._select_json(result, request)
            body["index"] = self._index
            payload = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        else:
            selection = result.selection
            partition = result.partition
            device = selection.overlap_blocks * partition.block_size
            if self._index_json[0] is not self._index:
                self._index_json = (self._index, orjson.dumps(self._index))
            sid = b"" if result.selection_id is None else b',"selection_id":' + orjson.dumps(result.selection_id)
            payload = b"".join(
                (
                    self._select_head(partition, selection.worker, result.endpoint, result.address),
                    b'%d,"gpu":%d,"dp":{"%d":%d},"cpu":%d,"disk":%d},"effective_prefill_tokens":%d,'
                    b'"potential_decode_blocks":%d,"isl_tokens":%d,"cost":'
                    % (
                        device,
                        device,
                        selection.worker[1],
                        device,
                        device,
                        device,
                        max(0, selection.isl_tokens - device),
                        selection.cost.decode_blocks,
                        selection.isl_tokens,
                    ),
                    orjson.dumps(selection.cost.total),
                    sid,
                    b',"index":',
                    self._index_json[1],
                    b"}",
                )
            )
        if self._json_headers[0] is not self._index_headers:
            headers = CIMultiDict(self._index_headers)
            headers[hdrs.CONTENT_TYPE] = JSON
            self._json_headers = (self._index_headers, headers)
        response = web.Response(body=payload, headers=self._json_headers[1])  # aiohttp copies the headers
        if result.address is not None:
            gateway = result.address
            if result.fallbacks:
                instances = result.partition.instances
                gateway = ",".join(
                    [gateway, *(a for k, _ in result.fallbacks if (a := _address(instances[k[0]].http_endpoint)))]
                )
            response.headers["X-Gateway-Destination-Endpoint"] = gateway
        return response

    async def _select_route(self, request: web.Request, *, reserve: bool) -> web.Response:
        started = time.perf_counter()
        raw = await request.read()
        select = fastparse.fast_select(raw)  # token ids straight into uint32 (fastparse.py)
        if select is None:
            select = parse_select(parse_body(raw))  # every other shape, and every error
        if select.session_id is None and (session := request.headers.get(SESSION_HEADER)):
            select = dataclasses.replace(select, session_id=session[:MAX_ID])  # the reference's header
        phases = self.counters.phases
        phases["parse"].observe(time.perf_counter() - started)
        result = await self.select_or_wait(select, reserve=reserve, gone=client_gone(request))  # queue.py
        serialising = time.perf_counter()
        response = self._select_response(result, select)
        done = time.perf_counter()
        phases["serialise"].observe(done - serialising)
        phases["total"].observe(done - started)
        return response

    async def _h_select(self, request: web.Request) -> web.Response:
        return await self._select_route(request, reserve=False)

    async def _h_select_and_reserve(self, request: web.Request) -> web.Response:
        return await self._select_route(request, reserve=True)

    async def _h_prefill_complete(self, request: web.Request) -> web.Response:
        self.prefill_complete(request.match_info["id"])
        return _json({"status": "ok"})

    async def _h_free(self, request: web.Request) -> web.Response:
        self.free(request.match_info["id"])
        return _json({"status": "ok"})

    async def _h_loads(self, request: web.Request) -> web.Response:
        out = []
        for name, partition in self.partitions.items():
            slots = partition.slots
            loads = [
                {
                    "worker_id": key[0],
                    "dp_rank": key[1],
                    "potential_prefill_tokens": slots.active_prefill_tokens(key),
                    "potential_decode_blocks": slots.active_blocks(key),
                    "active_requests": slots.active_requests(key),
                    "recent_prefill_tokens": round(slots.recent_prefill_tokens(key), 3),
                    "schedulable": key not in partition.unhealthy,
                }
                for key in partition.worker_keys()
            ]
            pending = self.pending(*name)  # queue.py
            out.append(
                {
                    "model_name": partition.model_name,
                    "routing_group": partition.routing_group,
                    "loads": loads,
                    "pending_count": pending[0],
                    "pending_isl_tokens": pending[1],
                }
            )
        return _json(out, headers=self._index_headers)

    async def _h_dump(self, request: web.Request) -> web.Response:
        encoder = Encoder()
        out: dict[str, Any] = {}
        for partition in self.partitions.values():
            events: list[Any] = []
            if partition.approx is not None:
                events = [
                    {
                        "worker_id": e.worker_id,
                        "storage_tier": "device",
                        "event": orjson.loads(encoder.encode_event(e)),
                    }
                    for e in partition.approx.dump()
                ]
            out[partition.name] = {
                "block_size": partition.block_size,
                "events": events,
                "complete": partition.approx is not None,
            }
        return _json(out, headers=self._index_headers)

    def _thresholds(self, partition: Partition) -> dict[str, Any]:
        config = partition.router.config
        return {
            "model_name": partition.model_name,
            "routing_group": partition.routing_group,
            "active_decode_blocks_threshold": config.active_decode_blocks_threshold,
            "active_prefill_tokens_threshold": config.active_prefill_tokens_threshold,
        }

    async def _h_busy_get(self, request: web.Request) -> web.Response:
        return _json({"thresholds": [self._thresholds(p) for p in self.partitions.values()]})

    async def _h_busy_set(self, request: web.Request) -> web.Response:
        body = await self._body(request)
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
        try:
            partition.set_thresholds(decode=None if decode is None else float(decode), prefill=prefill)
        except ConfigError as exc:
            raise ServiceError(400, str(exc)) from exc
        self._event("busy_threshold", **self._thresholds(partition))
        self.queue.changed(partition)  # queue.py
        return _json(self._thresholds(partition))

    def _since(self, request: web.Request) -> int:
        raw = request.query.get("since", "0")
        try:
            return int(raw)
        except ValueError as exc:
            raise ServiceError(400, f"since: expected an integer, got {raw!r}") from exc

    @staticmethod
    def _after(ring: Iterable[dict[str, Any]], since: int) -> list[dict[str, Any]]:
        return [entry for entry in ring if entry["seq"] > since]

    async def _h_decisions(self, request: web.Request) -> web.Response:
        since = self._since(request)
        return _json({"last": self._decision_seq, "decisions": self._after(self.decisions, since)})

    async def _h_events(self, request: web.Request) -> web.Response:
        since = self._since(request)
        return _json({"last": self._event_seq, "events": self._after(self.events, since)})
