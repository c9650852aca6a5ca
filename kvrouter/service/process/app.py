"""``Service``: the router service in one process: its core, its edges, its engine, started, run and stopped.

The composition root. It builds the core (``service/core/``: registry, reservations, decisions, rings)
over this process's index (front 0 owns the :class:`~kvrouter.engine.Engine` and its appliers; another
front of ``--fronts N`` maps it read-only), puts the edges on it (``service/edges/``: the aiohttp routes,
the hot lane, the ZMQ fast path, the proxy, ``/metrics``), and adds what a running process has beside
them: the health loop, the replica sync, the kv-events relay and durable events, the stats segment and the
discovery file for ``kvrouter top``, the other fronts. It is the one place that knows whether this process
is front 0. Every route is a few microseconds of synchronous work on the core, so one asyncio loop with no
locks serves it all: a thread pool would add a hand-off per request and a lock around every router, and
gain nothing on two cores.

**The start.** :meth:`Service.start` forks the engine's fork server and, with ``--fronts N``, the fronts'
(the only forks, before any thread);
:meth:`Service.run` binds at once, so ``/health`` answers from the first second, and brings the index up
on a thread of its own (a first run compiles its kernels for about a minute). Meanwhile the lifecycle is
``starting``: the routes that need the index answer 503 with ``Retry-After``, registry writes are taken
and wait (``core/registry.py``), and everything else answers with what it knows. Once the index is up the
waiting workers are followed, in order, and the service serves; if it never comes up they are reported
failed and :meth:`run` raises. **The stop** (:meth:`Service.stop`, from any thread or a signal handler)
turns ``/ready`` to 503, refuses new work, drains what is in flight for at most ``drain_secs``, then closes
the sockets and the engine (which unlinks every segment). Nothing in it writes to stdout or stderr on its
way (``kvrouter/stdio.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

from aiohttp import web

from ...bridge import ReplicaSync, Subjects, localbus
from ...bridge.durable import DurableEvents, consumer_name
from ...bridge.events import NatsEventRelay
from ...engine import Engine, EngineView
from ...errors import BadRequest, ConfigError, EngineError, KvRouterError
from ...recording import Recorder
from ...routing.router import Router
from ...stats import discovery
from ..core.config import ServiceConfig, WorkerRole
from ..core.counters import ServiceCounters
from ..core.recording import ServiceRecording, tap_endpoint
from ..core.requests import Registration, parse_registration, parse_thresholds, parse_unregistration
from ..core.state import Core
from ..edges import fastparse
from ..edges.answers import SelectAnswers
from ..edges.chat import ChatRoutes, load_chat_models
from ..edges.fastpath import FastPath
from ..edges.gate import Gate
from ..edges.lane import Lane
from ..edges.metrics import Metrics
from ..edges.proxy import CompletionsProxy
from ..edges.routes import Routes
from .fastpath_relay import FastPathRelay
from .follower import EngineFollower
from .fronts import Fronts, FrontSpec
from .health import Health
from .sharing import Sharing
from .stats import StatsPublisher

__all__ = ["Service"]

log = logging.getLogger(__name__)

ABANDON_START_S: Final = 1.0
"""How long a stop in the middle of the start waits for the start to end before leaving it behind: the
engine's close ends a wait for the appliers at once, but the front's compile (seconds to a minute on a
cold numba cache) cannot be cut short, and SIGTERM must end ``kvrouter up`` within ``drain_secs`` + 5 s."""
DRAIN_POLL_S: Final = 0.005


START_FULL_COLLECTION_THRESHOLD: Final = 1 << 30
"""While the index starts, the oldest generation's threshold: full collections wait for the start's end."""


def _hold_full_collections() -> tuple[int, int, int]:
    """Freeze what the imports made and hold full collections until the start is over; returns the
    thresholds to restore. Why: the start thread's compile (a first run's minute) grows the heap by hundreds
    of thousands of objects, and each full collection it triggers walks them all with the GIL held: 0.1 to
    0.3 s each on an idle machine, 1.7 s on a loaded one, every request on the loop waiting (a young
    generation's collection walks only the young). One full collection after the start (0.5 s) is the only
    pause left, and a warm start has nothing to collect."""
    gc.freeze()
    held = gc.get_threshold()
    gc.set_threshold(held[0], held[1], START_FULL_COLLECTION_THRESHOLD)
    return held


def warm_kernels(index: Engine | EngineView, config: ServiceConfig) -> None:
    """Compile (or load from numba's cache) every kernel a first request calls: the router's, the parser's
    and both query walks (in approximate mode too: the kernels are the same, and only an exact router
    decides on the engine's index). A load left to the first ``/query`` cost it 17-35 ms, a compile
    seconds (``tests/service/process/test_warm.py``)."""
    router = Router(replace(config.router, use_kv_events=True), block_size=16, seed=0)
    router.select(index, ((0, 0),), tokens=list(range(64)))
    fastparse.warm()
    index.find_matches([1, 2, 3])
    index.find_matches_by_tier([1, 2, 3])  # /query walks with a kernel of its own


class _FrontsWarmUp:
    """The fronts' fork server's ``prepare``: before its first fork, :func:`warm_kernels` in the server, on a
    view of the engine's segments, so every front it forks starts with them loaded, in pages they share."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.done = False

    def __call__(self, spec: FrontSpec) -> None:
        if self.done:
            return
        self.done = True  # once, even if it fails: each front then loads what it needs itself
        view = EngineView(spec.handle)
        try:
            warm_kernels(view, self.config)
        finally:
            view.close()


class Service:
    """The router service: ``service = Service(config); service.start()`` (forks: before any thread or
    loop), then ``asyncio.run(service.run(on_ready=...))`` until :meth:`stop`.

    ``core`` is the state the edges serve (register, decide, book: ``service/core/``); :attr:`app` is the
    aiohttp application, to which routes may be added before ``run``.
    """

    def __init__(
        self,
        config: ServiceConfig,
        *,
        front: FrontSpec | None = None,
        front_main: Callable[[FrontSpec, int], None] | None = None,
    ) -> None:
        """``front``: this process is that other front of ``--fronts N``. ``front_main``: on front 0 of
        ``--fronts N``, what each other front runs once forked, ``front_main(spec, connections)``
        (``kvrouter up`` gives ``cli/front.py``'s)."""
        self.config = config
        self._front_main = front_main
        self.recording: ServiceRecording | None = None
        """``--record FILE``: the front's records, the held clock and the seed."""
        plane = config.plane
        if config.record is not None and front is None:
            endpoint = tap_endpoint(config.record)
            plane = replace(plane, record_endpoint=endpoint)  # every applier copies what it applies there
            self.recording = ServiceRecording(config, endpoint)
        self.owned: Engine | None = (
            Engine(shards=config.shards, plane=plane, max_index_blocks=config.max_index_blocks)
            if front is None
            else None
        )
        """The engine, on front 0 (which owns it); None on another front."""
        self.engine: Engine | EngineView = (
            self.owned if self.owned is not None else EngineView(front.handle, front.applier_endpoints)  # type: ignore[union-attr]
        )
        self.core = Core(config, self.engine, recording=self.recording)
        self.url = ""
        self.started_at = time.time()
        """When the service was built (``time.time()``): ``kvrouter top``'s uptime."""

        self.relay: NatsEventRelay | None = None
        self.durable: DurableEvents | None = None
        """``durable_kv_events``: the JetStream consumer and snapshots feeding the relay (``bridge/durable.py``)."""
        self.follower: EngineFollower | None = None
        """What makes the engine follow registered workers: front 0 with KV events on."""
        if self.owned is not None and config.router.use_kv_events:
            if config.durable_kv_events:
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
            self.follower = EngineFollower(self.owned, config, relay=self.relay, durable=self.durable)
            self.core.registry.follower = self.follower

        self.fronts: Fronts | None = (
            Fronts(self.core, self.owned, self.apply_control, self.stop, front) if config.fronts > 1 else None
        )
        self.sync: ReplicaSync | None = None
        """The replica sync, over NATS (``replica_sync``) or the fronts' local bus."""
        subjects = Subjects(config.namespace, config.component)
        expiry = config.active_request_expiry_secs
        if config.replica_sync:
            self.sync = ReplicaSync(config.nats_url, subjects, self.core.replica_host, expiry_secs=expiry)
        elif self.fronts is not None:  # the fronts of one machine, without NATS: the same sync on the local bus
            self.sync = ReplicaSync(
                self.fronts.endpoint, subjects, self.core.replica_host, expiry_secs=expiry, connect=localbus.connect
            )
        if self.sync is not None:
            self.core.connect_peers(self.sync)

        self.gate = Gate(config, self.core.lifecycle, self.core.counters)
        self.answers = SelectAnswers(self.core.facts, self.core.counters)
        self.routes = Routes(self.core, self, self.gate, self.answers)
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self.routes.middleware])
        self.routes.add_to(self.app)
        Metrics(self.core, self).add_to(self.app)
        self.proxy = CompletionsProxy(self.core)
        """``POST /v1/completions`` (its counters: client gone, retried, failed)."""
        self.proxy.add_to(self.app)
        self.chat = ChatRoutes(self.core, self.proxy, load_chat_models(config))
        """``POST /v1/chat/completions`` (over the proxy) and ``GET /v1/models``."""
        self.chat.add_to(self.app)
        self.relay_fastpath: FastPathRelay | None = None
        """Front 0 of ``--fronts N``: the fast path's one endpoint, relayed to every front."""
        self.fastpath: FastPath | None = None
        """The ZMQ fast path (None when off): this process's share of it."""
        if front is not None:
            if front.fastpath is not None:
                self.fastpath = FastPath(self.core, self.gate, 0, relay=front.fastpath)
        elif config.zmq_port is not None:
            if self.fronts is not None:
                assert self.fronts.folder is not None
                backend = f"ipc://{self.fronts.folder}/fastpath"
                self.relay_fastpath = FastPathRelay(config.host, config.zmq_port, backend, config.max_body_bytes)
                self.fronts.fastpath = backend
                self.fastpath = FastPath(self.core, self.gate, 0, relay=backend)
            else:
                self.fastpath = FastPath(self.core, self.gate, config.zmq_port)
        self.health = Health(
            self.core,
            self.engine,
            sync=lambda: self.sync,
            relay=lambda: self.follower.relay if self.follower is not None else None,
            durable=lambda: self.durable,
            fronts=lambda: self.fronts.status() if self.fronts is not None else None,
        )
        self.lane: Lane | None = None
        """The hot routes' HTTP (``edges/lane.py``), while the service listens."""
        self.stats: StatsPublisher | None = None
        """The stats segment's publisher while the service serves; None before and after."""
        self._discovery: Any = None
        self._forked = False
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None

    # -- what the edges ask of the process (edges/host.py) ---------------------------------------

    @property
    def front(self) -> int | None:
        return None if self.fronts is None else self.fronts.index

    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """A registry write, done here on front 0, or by front 0 on another front (``fronts.py``)."""
        if self.fronts is not None and not self.fronts.primary:
            return await self.fronts.forward(op, body)
        answer = self.apply_control(op, body)
        if self.fronts is not None:
            await self.fronts.held()  # every front routes with the change before the client hears of it
        return answer

    def apply_control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """A registry write on front 0; the other fronts hear of the change.

        Raises:
            ServiceError: the registry's refusal; BadRequest for a body it cannot take or an unknown ``op``.
        """
        registry = self.core.registry
        answer: dict[str, Any]
        if op == "register":
            registry.register(parse_registration(body, endpoint_required=self.config.router.use_kv_events))
            answer = {"status": "ok"}
        elif op == "unregister":
            answer = {"status": "ok", "removed_ranks": registry.unregister(parse_unregistration(body))}
        elif op == "busy":
            answer = registry.set_thresholds(parse_thresholds(body))
        else:
            raise BadRequest(f"unknown control operation {op!r}")
        if self.fronts is not None:
            self.fronts.changed()
        return answer

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return self.health.ready()

    async def find_decision(self, selection_id: str) -> dict[str, Any] | None:
        """The decision as it was made, from this front's ring or, with ``--fronts N``, another front's."""
        found = self.core.records.explained(selection_id)
        if found is not None:
            return found
        if self.fronts is not None:
            return await self.fronts.find_decision(selection_id)
        return None

    def fleet_counters(self) -> ServiceCounters:
        """This front's counters, or with ``--fronts N`` every front's summed."""
        return self.core.counters if self.fronts is None else self.fronts.counters()

    def fastpath_requests(self) -> dict[str, int]:
        """The fast path's messages per op (this front's)."""
        return self.fastpath.counters.requests if self.fastpath is not None else {}

    @property
    def recorder(self) -> Recorder | None:
        """The ``--record`` writer (its counters for ``/metrics``); None when not recording."""
        return None if self.recording is None else self.recording.recorder

    @property
    def fastpath_endpoint(self) -> str | None:
        """Where clients reach the fast path (``tcp://host:port``), once bound; None when off."""
        if self.relay_fastpath is not None:
            return self.relay_fastpath.endpoint
        return None if self.fastpath is None else self.fastpath.endpoint

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Fork the engine's fork server, and on front 0 of ``--fronts N`` the fronts' first: the only forks
        this process makes, so call it before any thread or event loop exists. Returns at once; :meth:`run`
        forks the appliers through it and waits for them (and for this process's own kernels to load or
        compile) off the event loop. Idempotent.

        Raises:
            EngineError: another engine runs in this process, or its segments are left behind.
        """
        if not self._forked and self.fronts is not None and self.fronts.primary:
            if self._front_main is None:
                raise ConfigError("--fronts N: front 0 needs front_main, what the other fronts run")
            self.fronts.fork(self._front_main, _FrontsWarmUp(self.config))  # before the engine takes its lock
        if not self._forked and self.owned is not None:
            self.owned.start(wait=False)
        self._forked = True

    def stop(self) -> None:
        """Ask :meth:`run` to drain and return; safe from any thread or a signal handler, idempotent."""
        self._stop_requested = True
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(event.set)

    @property
    def stopping(self) -> bool:
        return self.core.lifecycle.stopping

    async def run(
        self,
        *,
        on_ready: Callable[[str], None] | None = None,
        on_listening: Callable[[str], None] | None = None,
    ) -> None:
        """Bind (``on_listening(url)``), bring the index up off the loop, follow the registered workers
        (``on_ready(url)``), serve until :meth:`stop`; then drain and close (module docstring).

        Raises:
            EngineError: the index did not come up (after the sockets and segments are closed).
        """
        config, core = self.config, self.core
        lifecycle = core.lifecycle
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        runner: web.AppRunner | None = None
        server: asyncio.Server | None = None
        tasks: list[asyncio.Task[None]] = []
        lifecycle.move("starting")
        try:
            if not self._forked:
                log.warning("service run without start: forking the fork server from a running loop")
                self.start()
            if core.decision_log is not None:
                core.decision_log.open()  # after the fork: the appliers hold no handle on it
            if self.recording is not None:
                self.recording.open()  # after the fork too: its thread and socket are this process's
            self._register_configured()
            fronts = self.fronts
            if fronts is not None and not fronts.primary:
                await fronts.open()  # the registry first: a front takes connections only once it can route
            runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=max(0.1, config.drain_secs))
            await runner.setup()
            assert runner.server is not None
            lane = self.lane = Lane(core, self, self.gate, self.answers, runner.server)
            if fronts is not None:
                fronts.prepare()  # the fronts' shared words
                assert fronts.serving is not None
                lane.sharing = fronts.sharing = Sharing(lane, fronts.serving, fronts.index, fronts.notify_owned)
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
            if self.relay_fastpath is not None:
                self.relay_fastpath.start()
            if self.fastpath is not None:
                await self.fastpath.start()
            shown = f"[{host}]" if ":" in str(host) else str(host)
            self.url = f"http://{shown}:{port}"
            log.info("service listening url=%s shards=%d", self.url, config.shards)
            if on_listening is not None:
                on_listening(self.url)
            held = _hold_full_collections()  # the compile's garbage must not stop the loop in the meantime
            starting = self._start_off_loop()
            stopped = asyncio.ensure_future(self._stop_event.wait())
            try:
                await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gc.set_threshold(*held)
            if not starting.done():  # stopped while starting: closing the engine ends a wait for the appliers
                stopped.cancel()
                lifecycle.move("stopping")
                self.engine.close()
                with contextlib.suppress(EngineError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(starting), ABANDON_START_S)
                return
            stopped.cancel()
            try:
                starting.result()  # raises EngineError when the appliers did not come up
            except KvRouterError as exc:
                lifecycle.move("failed", str(exc))
                core.registry.fail_waiting(f"the index did not start: {exc}")
                raise
            if self.follower is not None:
                self.follower.up = True
            lifecycle.move("serving")
            self.health.refresh_index()
            core.journal.event("engine started", shards=config.shards)
            core.registry.follow_waiting()
            self.health.open()
            tasks.append(asyncio.create_task(self.health.run(), name="kvrouter-health"))
            if self.sync is not None:
                tasks.append(asyncio.create_task(self.sync.run(), name="kvrouter-sync"))
            if self.durable is not None:
                tasks.append(asyncio.create_task(self.durable.run(), name="kvrouter-durable"))
            if fronts is not None and fronts.primary:
                await fronts.start_fronts(port)
            if self.owned is not None:  # front 0 speaks for the fronts to kvrouter top
                self._publish_stats(tasks)
            if core.decision_log is not None:
                tasks.append(asyncio.create_task(core.decision_log.run(), name="kvrouter-decision-log"))
            # What the start left (numba's kernels and type system, aiohttp, the rest: about 140,000 tracked
            # objects) lives as long as the process: frozen, a full collection no longer walks it. Walked, one
            # held the loop, and every request on it, for 55-80 ms (0.01 ms frozen; 16 workers registered).
            # A first run's compile left its garbage too (about 600,000 objects): collected once, first.
            gc.collect()
            gc.freeze()
            if fronts is not None and not fronts.primary:
                fronts.ready()  # front 0 deals this front connections from now on
            if on_ready is not None:
                on_ready(self.url)
            await self._stop_event.wait()
            lifecycle.move("stopping")
            if fronts is not None and fronts.primary:
                fronts.stop_others()  # every front drains at once, not one after the other
            core.queue.close()  # waiters are refused
            core.journal.event("stopping", inflight=lifecycle.inflight)
            deadline = time.monotonic() + config.drain_secs
            while lifecycle.inflight and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if lifecycle.inflight:
                log.warning("drain incomplete inflight=%d drain_secs=%s", lifecycle.inflight, config.drain_secs)
        finally:
            if lifecycle.phase != "failed":
                lifecycle.move("stopping")
            await self._close(tasks, server, runner)
            if lifecycle.phase != "failed":
                lifecycle.move("stopped")
            log.info("service stopped url=%s", self.url)

    async def _close(
        self, tasks: list[asyncio.Task[None]], server: asyncio.Server | None, runner: web.AppRunner | None
    ) -> None:
        """Close everything :meth:`run` opened, in an order that loses nothing: the sync's queued events go
        out, the other fronts drain before the engine goes, the appliers' last records reach the recording."""
        if self.sync is not None:
            await self.sync.close()  # before its task is cancelled: queued events go out first
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.health.close()
        if self.durable is not None:
            await self.durable.close()
        if self.follower is not None:
            await self.follower.close()
            if self.follower.relay is not None:
                await self.follower.relay.close()
        if self.fronts is not None:
            await self.fronts.close()  # front 0: the other fronts drain and stop before the engine goes
        self._withdraw_stats()
        if self.core.decision_log is not None:
            self.core.decision_log.close()  # what the last second decided, written
        if self.fastpath is not None:
            await self.fastpath.close()
        if self.relay_fastpath is not None:
            self.relay_fastpath.close()
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

    def _register_configured(self) -> None:
        """``config.workers`` (``--workers``), registered first: they wait with the rest while the index starts."""
        config = self.config
        roles = {role.worker_id: role for role in config.worker_roles}
        for spec in config.workers:
            role = roles.get(spec.worker_id, WorkerRole(spec.worker_id))
            for rank in spec.dp_ranks:
                self.core.registry.register(
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
                        role=role.role,
                        topology_domain=role.topology_domain,
                        lora_adapters=role.lora_adapters,
                    )
                )

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
        engine = self.owned
        if engine is not None:
            view = EngineView(engine.reader_handle())
            try:
                warm_kernels(view, self.config)
            finally:
                view.close()
            engine.finish_start()
        else:
            warm_kernels(self.engine, self.config)

    def _evicted(self) -> int:
        """Entries the index cap evicted so far, over every shard (0 when the engine cannot say)."""
        try:
            return sum(sum(shard.evicted.values()) for shard in self.engine.stats(workers=False))
        except EngineError:
            return 0

    def _publish_stats(self, tasks: list[asyncio.Task[None]]) -> None:
        """The stats segment and its 4 Hz task, then the discovery file (``kvrouter top``'s way in). A failure
        of either is logged and the service serves on without it: the dashboard is not the router."""
        publisher = StatsPublisher(self.core, self)
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
