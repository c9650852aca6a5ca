"""``kvrouter up --fronts N``: N front processes answering on one port, as one router.

One Python process answers about 4,000 ``/select`` a second on this machine's class of core, most of it
HTTP work per request (``docs/http-api.md``); more fronts answer more. The layout:

- **Front 0** is ``kvrouter up`` itself: it owns the engine (the appliers and their segments), the worker
  registry, the stats segment and the discovery file, and it runs the *local bus*
  (``bridge/localbus.py``), an ``ipc://`` broker in a private directory (``<runtime dir>/fronts-<pid>/``,
  mode 0700). Once its engine is up and its command-line workers are registered it starts fronts
  1..N-1 and is ready when they are.
- **Fronts 1..N-1** are forked by the fronts' fork server, which front 0 forks before it has any thread
  (:meth:`Fronts.fork`; the server warms what a front runs, then forks each one, restarts too), each given
  a :class:`FrontSpec` and its end of a socketpair with front 0. Each maps the engine's index
  read-only (:class:`~kvrouter.engine.EngineView`: the design card's lock-free readers).
- **Every front serves every connection.** Front 0 listens on the port and accepts every connection;
  each one goes, numbered, to the two fronts that serve it, in turn over the ready fronts (front 0 and
  the other, with two fronts), over each front's Unix socketpair (``SCM_RIGHTS``, :meth:`Fronts.deal`), and
  whichever of them is free answers its next request (``sharing.py``: a lock per request on the socket).
  Two, not all: each request wakes every front that holds it, so with more fronts than two every request
  would wake more fronts for nothing. A front that dies leaves nothing hanging: front 0 ends the connections it was
  answering or owned (``sharing.py``, and :meth:`Fronts.orphaned`). Rejected: ``SO_REUSEPORT`` on every
  front (the kernel spreads connections by a hash of their addresses, so a client's few keep-alive
  connections often land unevenly and stay so: 3/5 and worse at 8 connections over 2 fronts); each
  connection dealt to one front for its life (even, 4 and 4, but a front's requests wait whenever the
  kernel runs something else on its core: the p99 of ``sharing.py``'s measurements).
- **The ZMQ fast path** keeps one endpoint: front 0 binds it and relays its messages to every front,
  front 0's own included, round robin, in a C-level ``zmq.proxy`` on a thread of its own
  (``fastpath_relay.py``); replies go back the same way.
- **Load views** agree the way replicas' do: each front runs the one
  :class:`~kvrouter.bridge.sync.ReplicaSync`, over the local bus (or over NATS with
  ``--router-replica-sync``, where the fronts are simply more replicas). Any front may complete or free
  any reservation.
- **The registry** (registrations, busy thresholds) has one writer, front 0, because only the engine's
  owner can make an applier follow a worker. A write route on another front (``/register``,
  ``/unregister``, ``POST /busy_threshold``) is a request on the bus's ``kvrouter.fronts.control``
  subject; front 0 does it and answers with its body (or its refusal's kind and message) and the whole
  registry, which the asking front applies before it answers its client (so a client reads its own write
  on any connection). Front 0 also publishes the registry after every change on
  ``kvrouter.fronts.registry``, and a front that starts asks for it on ``kvrouter.fronts.registry.get``.
  The whole registry each time, versioned: a few KB even for a large fleet, and a front never has to
  replay a history.

Every answer carries ``X-Kvrouter-Front: <k>``. **Counters** (decisions, HTTP requests, the histograms)
are published by each front every second on ``kvrouter.fronts.counters``; each front answers ``/metrics``
(and front 0 fills the stats segment ``kvrouter top`` reads) with the sum, so a scrape through the shared
port reads the same totals on any front; a restarted front's last figures stay in the sum. Rejected:
prometheus-client's multiprocess mode (a file per process and metric, written on every observation).
Per front, not shared: the decisions and events rings, the router queue, session affinity and, in
approximate mode, the approximate index (each learns only its own decisions). A front that exits is started
again after :data:`RESTART_DELAY_S`, and counted; fronts exit when front 0 goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import orjson

from ...bridge import localbus
from ...engine import Engine, ReaderHandle
from ...errors import EngineError, ServiceError, Unavailable, refusal_of
from ...index.forkserver import ForkServer
from ...stats import discovery
from ..core.config import ServiceConfig
from ..core.counters import ServiceCounters
from ..core.requests import Registration, Thresholds, Unregistration
from ..core.state import Core
from ..edges.lane import Lane
from .sharing import Serving, Sharing

__all__ = ["CONTROL_SUBJECT", "FrontSpec", "Fronts"]

log = logging.getLogger(__name__)

CONTROL_SUBJECT: Final = "kvrouter.fronts.control"
REGISTRY_SUBJECT: Final = "kvrouter.fronts.registry"
REGISTRY_GET_SUBJECT: Final = "kvrouter.fronts.registry.get"
REGISTRY_ACK_SUBJECT: Final = "kvrouter.fronts.registry.ack"
ACK_TIMEOUT_S: Final = 2.0
"""How long front 0 waits for every ready front to hold a registry change before it answers the write
anyway (a front that far behind is logged; its next registry message brings it up to date)."""
COUNTERS_SUBJECT: Final = "kvrouter.fronts.counters"
DECISION_SUBJECT: Final = "kvrouter.fronts.decision"
DECISION_TIMEOUT_S: Final = 0.3
"""How long a front waits for the one that keeps a decision asked by id (a front without it stays silent)."""
COUNTERS_INTERVAL_S: Final = 1.0
"""How often each front publishes its counters: the others' part of a scrape is at most this old."""
CONTROL_TIMEOUT_S: Final = 10.0
"""How long a front waits for front 0 to do a write route (a registration waits on the engine)."""
READY_TIMEOUT_S: Final = 300.0
"""How long front 0 waits for a started front to say it is ready (a cold numba cache compiles for minutes)."""
RESTART_DELAY_S: Final = 1.0
ACK_POLL_S: Final = 0.002
STOP_TIMEOUT_S: Final = 10.0
"""After SIGTERM, how long a front has to drain before it is killed (on top of ``drain_secs``)."""
PARENT_POLL_S: Final = 0.5
MAX_OWNED_KEPT: Final = 4096
"""Front 0 keeps at most about this many numbers of connections a front owns before it forgets the ended ones."""
MAX_DEALT: Final = 64
"""Connections one read of a front's socketpair takes at most (front 0 sends one per message)."""
READY: Final = b"r"
"""What a front sends front 0 on its socketpair once it serves (its connections arrive there from then on)."""


@dataclass(frozen=True, slots=True)
class FrontSpec:
    """What front ``index`` (1..N-1) is forked with: its parent's config (with the bound port), the engine to
    map and the bus to join (its logging is front 0's, inherited with the fork)."""

    config: ServiceConfig
    index: int
    handle: ReaderHandle
    applier_endpoints: tuple[str, ...]
    """Where the front sends the blocks its decisions matched (``EngineView.touch``)."""
    bus: str
    parent: int
    """The fronts' fork server's pid: a front whose parent changes stops (the server leaves with front 0)."""
    connections: int = -1
    """The front's end of its socketpair with front 0, given with its fork: its connections arrive there."""
    fastpath: str | None = None
    """Front 0's fast-path relay (``fastpath_relay.py``) this front serves, or None (no fast path)."""
    serving: str = ""
    """The fronts' shared segment (``sharing.py``'s :class:`Serving`): each front's word."""


class _FrontProcess:
    """Front 0's handle on another front's process: a pidfd to signal it (never a reused pid), and its exit
    status (None when the fork server went first), set when the fork server reports it reaped."""

    def __init__(self, pid: int, pidfd: int, exited: asyncio.Future[int | None]) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.exited = exited

    @property
    def running(self) -> bool:
        return not self.exited.done()

    def ended(self, code: int | None) -> None:
        if not self.exited.done():
            self.exited.set_result(code)
        self.close()

    def signal(self, signum: int) -> None:
        if self.running and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):  # exited, not reaped and reported yet
                signal.pidfd_send_signal(self._pidfd, signum)

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class Fronts:
    """One front's end of the fronts of a ``kvrouter up``: front 0's (``spec`` None) or another's.

    ``apply`` is front 0's registry write (``op``, body) -> answer; ``stop`` stops this front's service.
    """

    def __init__(
        self,
        core: Core,
        engine: Engine | None,
        apply: Callable[[str, dict[str, Any]], dict[str, Any]],
        stop: Callable[[], None],
        spec: FrontSpec | None = None,
    ) -> None:
        self.core = core
        self.engine = engine
        self._apply = apply
        self._stop = stop
        self.spec = spec
        self.index = 0 if spec is None else spec.index
        self.count = core.config.fronts
        self.primary = spec is None
        self.folder = discovery.runtime_dir() / f"fronts-{os.getpid()}" if spec is None else None
        self.endpoint = spec.bus if spec is not None else f"ipc://{self.folder}/bus"
        self.version = 0
        """The registry's version: front 0 counts its changes; another front holds the last it applied."""
        self.restarts = 0
        """Fronts started again after they exited."""
        self._broker: localbus.LocalBroker | None = None
        self._bus: localbus.LocalBus | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._forks: ForkServer | None = None
        """Front 0: the fronts' fork server (:meth:`fork`), until :meth:`close`."""
        self._spawning = asyncio.Lock()
        self._processes: dict[int, _FrontProcess] = {}
        """Front 0: each other front's process, the last one started for its index."""
        self._reaped: dict[int, int] = {}
        """Front 0: exits the fork server reported before its answer to their fork reached the loop."""
        self._forking: asyncio.Future[int] | None = None
        """Front 0: the last fork asked of the server (a stop waits for it before it closes the server)."""
        self._ready: set[int] = set()
        """Fronts (1..N-1) that said they are ready and have not exited since."""
        self._stopping = False
        self._peers: dict[int, tuple[int, ServiceCounters]] = {}
        """Another front's index -> (its pid, its counters as last published)."""
        self._retired = ServiceCounters()
        """The counters of fronts that exited (their last publication): sums stay monotonic across a restart."""
        self.bad_counters = 0
        """Counter publications that did not decode (counted, logged once)."""
        self._channels: dict[int, socket.socket] = {}
        """Front 0: the ready fronts' socketpair ends, where :meth:`deal` sends their connections."""
        self._inbox: socket.socket | None = None
        """Another front: where its connections arrive."""
        self._arriving: set[asyncio.Task[Any]] = set()
        self._numbered = 0
        """Front 0: the last number given to an accepted connection."""
        self.serving: Serving | None = None
        """The fronts' shared words (``sharing.py``), from :meth:`prepare` to :meth:`close`."""
        self.sharing: Sharing | None = None
        """This front's share of the connections (set by the service once its lane exists)."""
        self._owned_by: dict[int, set[int]] = {}
        """Front 0: per other front, the numbers of the connections it made its own."""
        self._acked: dict[int, int] = {}
        """Front 0: the registry version each front last said it holds."""
        self.fastpath: str | None = None
        """Front 0: the fast-path relay's endpoint the other fronts serve (set before they start)."""

    # -- both ends ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``/ready``'s ``fronts``: this front, how many, the registry version, the others' processes."""
        answer: dict[str, Any] = {"front": self.index, "fronts": self.count, "registry_version": self.version}
        if self.primary:
            answer["ready"] = 1 + len(self._ready)
            answer["restarts"] = self.restarts
        return answer

    def prepare(self) -> None:
        """Before the service listens: the fronts' shared words (front 0 makes them, the others map them)."""
        if self.primary:
            self.serving = Serving.create(os.getpid())
        else:
            assert self.spec is not None
            self.serving = Serving.attach(self.spec.serving)

    def notify_owned(self, connection_id: int) -> None:
        """This front made connection ``connection_id`` its own: front 0 is told (ends it if this front dies)."""
        inbox = self._inbox
        if self.primary or inbox is None:
            return  # front 0's own end with front 0
        with contextlib.suppress(OSError):  # front 0 gone: this front stops anyway
            inbox.send(b"o" + connection_id.to_bytes(8, "little"))

    def orphaned(self, index: int) -> int:
        """Front 0, when front ``index`` exited: end the connection it was answering and those it owned (a
        ``shutdown``: their clients get an end of file or a reset), then read every shared connection again
        for requests it had locked but not read. Returns how many connections were ended."""
        ids = self._owned_by.pop(index, set())
        serving = self.serving
        if serving is not None:
            answering = int(serving.words[index])
            serving.words[index] = 0
            if answering:
                ids.add(answering)
        sharing = self.sharing
        if sharing is None:
            return 0
        ended = sum(sharing.shut(connection_id) for connection_id in ids)
        sharing.reread()
        if ended:
            log.warning("front exited while serving front=%d connections ended=%d", index, ended)
        return ended

    def _on_notice(self, index: int, channel: socket.socket) -> None:
        """Front 0: a front's notice on its socketpair (``o`` + a connection's number: made its own)."""
        try:
            message = channel.recv(16)
        except BlockingIOError:
            return
        except OSError:
            message = b""
        if not message:  # the front's end closed: it exited (its process watch handles the rest)
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(channel.fileno())
            return
        if message[:1] == b"o" and len(message) == 9:
            owned = self._owned_by.setdefault(index, set())
            owned.add(int.from_bytes(message[1:], "little"))
            if len(owned) > MAX_OWNED_KEPT and self.sharing is not None:  # the ended ones go
                owned.intersection_update(self.sharing.by_id)

    async def open(self) -> None:
        """Front 0: the broker (before the replica sync connects to it). Others: join the bus and take the
        registry from front 0."""
        if self.primary:
            assert self.folder is not None
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._broker = localbus.LocalBroker(self.endpoint)
            self._tasks.append(asyncio.create_task(self._broker.run(), name="kvrouter-fronts-broker"))
            self._bus = await localbus.connect([self.endpoint], name="front-0")
            await self._bus.subscribe(CONTROL_SUBJECT, cb=self._on_control)
            await self._bus.subscribe(REGISTRY_GET_SUBJECT, cb=self._on_registry_get)
            await self._bus.subscribe(REGISTRY_ACK_SUBJECT, cb=self._on_registry_ack)
        else:
            self._bus = await localbus.connect([self.endpoint], name=f"front-{self.index}")
            await self._bus.subscribe(REGISTRY_SUBJECT, cb=self._on_registry)
            answer = await self._bus.request(REGISTRY_GET_SUBJECT, b"{}", timeout=CONTROL_TIMEOUT_S)
            self.apply(orjson.loads(answer.data))
            self._tasks.append(asyncio.create_task(self._watch_parent(), name="kvrouter-fronts-parent"))
        await self._bus.subscribe(COUNTERS_SUBJECT, cb=self._on_counters)
        await self._bus.subscribe(DECISION_SUBJECT, cb=self._on_decision)
        self._tasks.append(asyncio.create_task(self._publish_counters(), name="kvrouter-fronts-counters"))

    async def close(self) -> None:
        """Stop the other fronts (front 0), leave the bus, stop the broker, remove the directory and the
        fronts' shared words (whatever failed on the way)."""
        self._stopping = True
        try:
            if self.primary:
                await self._stop_fronts()
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks.clear()
            for channel in self._channels.values():
                with contextlib.suppress(ValueError, OSError):
                    asyncio.get_running_loop().remove_reader(channel.fileno())
                channel.close()
            self._channels.clear()
            if self._inbox is not None:
                asyncio.get_running_loop().remove_reader(self._inbox.fileno())
                self._inbox.close()
                self._inbox = None
            if self._bus is not None:
                await self._bus.close()
                self._bus = None
            if self._broker is not None:
                self._broker.close()
                self._broker = None
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
            if self.serving is not None:
                self.serving.close()  # front 0 unlinks it
                self.serving = None

    # -- counters: every front's, summed -------------------------------------------------------------

    def counters(self) -> ServiceCounters:
        """This front's counters now, plus the others' as last published, plus those of fronts that exited:
        what ``/metrics`` and ``kvrouter top`` show, the same on every front (up to a second behind)."""
        total = ServiceCounters()
        total.add(self.core.counters)
        total.add(self._retired)
        for _, theirs in self._peers.values():
            total.add(theirs)
        return total

    async def _publish_counters(self) -> None:
        assert self._bus is not None
        while True:
            await asyncio.sleep(COUNTERS_INTERVAL_S)
            wire = {"front": self.index, "pid": os.getpid(), "counters": self.core.counters.to_wire()}
            await self._bus.publish(COUNTERS_SUBJECT, orjson.dumps(wire))

    async def _on_counters(self, msg: localbus.LocalMessage) -> None:
        try:
            body = orjson.loads(msg.data)
            index, pid = int(body["front"]), int(body["pid"])
            counters = ServiceCounters.from_wire(body["counters"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            self.bad_counters += 1
            if self.bad_counters == 1:
                log.warning("fronts: a counters message did not decode error=%r", exc)
            return
        if index == self.index:
            return
        known = self._peers.get(index)
        if known is not None and known[0] != pid:  # that front was started again: keep what it had counted
            self._retired.add(known[1])
        self._peers[index] = (pid, counters)

    # -- decisions by id ------------------------------------------------------------------------------

    async def find_decision(self, selection_id: str) -> dict[str, Any] | None:
        """A decision another front made and keeps (``GET /decisions/{id}`` reached the wrong front)."""
        if self._bus is None:
            return None
        try:
            answer = await self._bus.request(DECISION_SUBJECT, selection_id.encode(), timeout=DECISION_TIMEOUT_S)
        except Exception:  # nats.errors.TimeoutError / NoRespondersError: no front keeps it
            return None
        found: dict[str, Any] = orjson.loads(answer.data)
        return found

    async def _on_decision(self, msg: localbus.LocalMessage) -> None:
        found = self.core.records.explained(msg.data.decode(errors="replace"))
        if found is not None:
            await msg.respond(orjson.dumps(found))

    # -- the registry -------------------------------------------------------------------------------

    def registry(self) -> dict[str, Any]:
        """Front 0's registry as the others apply it."""
        registry = self.core.registry
        return {
            "version": self.version,
            "registrations": [asdict(reg) for reg in registry.registrations.values()],
            "thresholds": [
                {
                    "model_name": p.model_name,
                    "routing_group": p.routing_group,
                    "decode": p.router.config.active_decode_blocks_threshold,
                    "prefill": p.router.config.active_prefill_tokens_threshold,
                }
                for p in registry.partitions.values()
            ],
        }

    def changed(self) -> None:
        """Front 0, after a change of the registry: publish it (queued on the loop); :meth:`held` waits
        until every ready front holds it."""
        if not self.primary:
            return
        self.version += 1  # counted before the bus opens too: a front that joins later takes this version
        if self._bus is None:
            return
        payload = orjson.dumps(self.registry())
        bus = self._bus
        self._tasks.append(asyncio.create_task(bus.publish(REGISTRY_SUBJECT, payload)))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def held(self) -> None:
        """Front 0: wait until every ready front holds the registry as it is now (at most
        :data:`ACK_TIMEOUT_S`), so a client that wrote through one front reads its write on any other."""
        version = self.version
        deadline = asyncio.get_running_loop().time() + ACK_TIMEOUT_S
        while any(self._acked.get(index, 0) < version for index in self._ready):
            if asyncio.get_running_loop().time() > deadline:
                behind = sorted(i for i in self._ready if self._acked.get(i, 0) < version)
                log.warning("fronts behind the registry version=%d fronts=%s: answering anyway", version, behind)
                return
            await asyncio.sleep(ACK_POLL_S)

    async def _on_registry_ack(self, msg: localbus.LocalMessage) -> None:
        try:
            body = orjson.loads(msg.data)
            index, version = int(body["front"]), int(body["version"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return
        self._acked[index] = max(version, self._acked.get(index, 0))

    def apply(self, registry: dict[str, Any]) -> None:
        """Another front: make its partitions what front 0's registry says (never the engine: front 0's)."""
        if registry["version"] <= self.version:
            return
        mine = self.core.registry
        desired = {}
        for fields in registry["registrations"]:
            reg = Registration(**{**fields, "lora_adapters": tuple(fields["lora_adapters"])})  # a list in JSON
            desired[reg.instance_id, reg.dp_rank] = reg
        for key in mine.registrations.keys() - desired.keys():
            gone = mine.registrations[key]
            request = Unregistration(gone.instance_id, gone.model_name, gone.routing_group, gone.dp_rank)
            self._mirrored(functools.partial(mine.unregister, request, mirror=True))
        for key, reg in desired.items():
            if key not in mine.registrations:
                self._mirrored(functools.partial(mine.register, reg, mirror=True))
        given = frozenset({"active_decode_blocks_threshold", "active_prefill_tokens_threshold"})
        for entry in registry["thresholds"]:
            model, group = entry["model_name"], entry["routing_group"]
            if (model, group) in mine.partitions:
                thresholds = Thresholds(model, group, entry["decode"], entry["prefill"], given)
                self._mirrored(functools.partial(mine.set_thresholds, thresholds, mirror=True))
        self.version = registry["version"]

    @staticmethod
    def _mirrored(change: Callable[[], object]) -> None:
        """Apply one change of front 0's registry here; front 0 took it, so a refusal here is a bug, logged."""
        try:
            change()
        except ServiceError as exc:
            log.error("front registry out of step: %s refused here: %s", type(exc).__name__, exc)

    async def _on_registry(self, msg: localbus.LocalMessage) -> None:
        self.apply(orjson.loads(msg.data))
        if self._bus is not None:
            await self._bus.publish(REGISTRY_ACK_SUBJECT, orjson.dumps({"front": self.index, "version": self.version}))

    async def _on_registry_get(self, msg: localbus.LocalMessage) -> None:
        await msg.respond(orjson.dumps(self.registry()))

    # -- write routes ---------------------------------------------------------------------------------

    async def forward(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Another front: front 0 does the write route; its registry is applied here before returning.

        Raises:
            ServiceError: front 0's refusal, of its kind; Unavailable when front 0 does not answer.
        """
        assert self._bus is not None
        try:
            answer = await self._bus.request(
                CONTROL_SUBJECT, orjson.dumps({"op": op, "body": body}), timeout=CONTROL_TIMEOUT_S
            )
        except Exception as exc:  # nats.errors.TimeoutError / NoRespondersError: front 0 is gone or stuck
            raise Unavailable(f"front 0 did not answer {op}: {type(exc).__name__}") from exc
        reply = orjson.loads(answer.data)
        if "refused" in reply:
            raise refusal_of(reply["refused"], reply["error"])
        self.apply(reply["registry"])
        answered: dict[str, Any] = reply["body"]
        return answered

    async def _on_control(self, msg: localbus.LocalMessage) -> None:
        reply: dict[str, Any]
        try:
            request = orjson.loads(msg.data)
            reply = {"body": self._apply(request["op"], request["body"])}
            await self.held()
        except ServiceError as exc:
            reply = {"refused": exc.kind, "error": str(exc)}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:  # not a control message
            reply = {"refused": "bad_request", "error": f"control message: {exc}"}
        except Exception as exc:  # a bug: the asking front answers 500, front 0 logs it
            log.exception("front control failed")
            reply = {"refused": "refused", "error": f"internal error ({type(exc).__name__})"}
        reply["registry"] = self.registry()
        await msg.respond(orjson.dumps(reply))

    # -- front 0: the other fronts' processes ------------------------------------------------------

    async def start_fronts(self, port: int) -> None:
        """Fork fronts 1..N-1 on the port front 0 bound and wait until each one says it is ready.

        Raises:
            ServiceError: a front exited, or was not ready within :data:`READY_TIMEOUT_S`.
        """
        if self._forks is not None:
            asyncio.get_running_loop().add_reader(self._forks.reports.fileno(), self._on_reports)
        starts = [self._start(index, port) for index in range(1, self.count)]
        await asyncio.gather(*starts)
        self._tasks.append(asyncio.create_task(self._supervise(port), name="kvrouter-fronts-supervise"))

    def _spec(self, index: int, port: int, parent: int) -> FrontSpec:
        config = replace(self.core.config, port=port, zmq_port=None, workers=())
        engine = self.engine
        assert engine is not None  # front 0 owns it
        return FrontSpec(
            config,
            index,
            engine.reader_handle(),
            engine.applier_endpoints(),
            self.endpoint,
            parent,
            -1,  # the front's own descriptor, given when it is forked
            self.fastpath,
            self.serving.name if self.serving is not None else "",
        )

    def fork(self, target: Callable[[FrontSpec, int], None], prepare: Callable[[FrontSpec], None]) -> None:
        """Front 0, before the process has any thread: fork the fronts' fork server (``index/forkserver.py``),
        which forks every other front, first start and restarts alike, running ``target(spec, connections)``
        after ``prepare(spec)`` warmed what a front runs in the server itself. Forked, the fronts share the
        server's pages (its imported modules and loaded kernels) until they write them: spawned, four fronts
        cost about a fifth more CPU per request than two, forked about nothing more (``docs/http-api.md``).

        Raises:
            EngineError: the server could not be forked.
        """
        assert self.primary  # Service.start, once, on front 0
        assert self._forks is None
        self._forks = ForkServer(target, warm=None, prepare=prepare)

    async def _start(self, index: int, port: int) -> None:
        forks = self._forks
        if forks is None:
            raise Unavailable("the fronts' fork server was not started (Service.start forks it)")
        loop = asyncio.get_running_loop()
        channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            async with self._spawning:  # one fork at a time; the first waits a second or two for the warm-up
                if self._stopping:
                    theirs.close()
                    raise Unavailable(f"front {index} not started: the service is stopping")
                spec = (self._spec(index, port, forks.pid),)
                forking = self._forking = loop.run_in_executor(None, forks.spawn, spec, (theirs.fileno(),))
                forking.add_done_callback(functools.partial(self._forked, index, theirs))
                try:
                    pid = await asyncio.shield(forking)  # a fork in flight is seen through, even by a stop
                except EngineError as exc:
                    raise Unavailable(f"front {index} not forked: {exc}") from exc
            process = self._processes[index]
            channel.setblocking(False)
            try:
                said = await asyncio.wait_for(loop.sock_recv(channel, 16), READY_TIMEOUT_S)
            except TimeoutError:
                raise Unavailable(f"front {index} was not ready in {READY_TIMEOUT_S:.0f}s") from None
            if said != READY:  # its end closed: it exited first
                code = await process.exited
                raise Unavailable(f"front {index} exited with status {code} before it was ready")
        except BaseException:  # not started, not ready, or cancelled: front 0's end goes too
            channel.close()
            raise
        log.info("front ready front=%d pid=%d", index, pid)
        self._channels[index] = channel
        loop.add_reader(channel.fileno(), self._on_notice, index, channel)
        self._ready.add(index)

    def _forked(self, index: int, theirs: socket.socket, forking: asyncio.Future[int]) -> None:
        """Front 0, once the fork server answered: the front's process is known (and asked to stop at once if
        the service began to stop meanwhile); the front holds its own end of the socketpair now."""
        theirs.close()
        if forking.cancelled() or forking.exception() is not None:
            return
        pid = forking.result()
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped already: its report says how
            pidfd = -1
        process = self._processes[index] = _FrontProcess(pid, pidfd, asyncio.get_running_loop().create_future())
        if pid in self._reaped:
            process.ended(self._reaped.pop(pid))
        if self._stopping:
            process.signal(signal.SIGTERM)

    def _on_reports(self) -> None:
        """Front 0: the fork server reaped fronts; each one's exit completes its process's ``exited``."""
        assert self._forks is not None
        reports = self._forks.reports
        try:
            while reports.poll():
                pid, code = reports.recv()
                running = {p.pid: p for p in self._processes.values() if p.running}
                if (process := running.get(pid)) is not None:
                    process.ended(code)
                else:  # reaped before its fork's answer reached the loop: _forked takes it
                    self._reaped[pid] = code
        except (EOFError, OSError):  # the server is gone: fronts can no longer be started again
            asyncio.get_running_loop().remove_reader(reports.fileno())
            if not self._stopping:
                log.error("fronts' fork server exited pid=%d: a front that exits is not started again", self._forks.pid)
            for process in self._processes.values():  # they stop too: their parent, the server, is gone
                process.ended(None)

    def ready(self) -> None:
        """Another front, serving: front 0 is told on the socketpair (``_start`` waits for it)."""
        if self._inbox is not None:
            with contextlib.suppress(OSError):  # front 0 gone: this front stops anyway
                self._inbox.send(READY)

    def deal(self, transport: asyncio.Transport) -> tuple[int, bool]:
        """Front 0, for each connection it accepts: number it and send a copy to the fronts that serve it
        together (``sharing.py``): two of them, in turn over the ready fronts, so each request wakes two
        fronts however many there are (front 0 and the other, with two). A front that cannot take it now
        (far behind, or gone) goes without. Returns the number, and whether front 0 is one of the two (else
        it keeps its copy only to end it if a front dies serving it)."""
        self._numbered += 1
        number = self._numbered
        sock = transport.get_extra_info("socket")
        turns = [0, *sorted(self._channels)]
        first = number % len(turns)
        pair = {turns[first], turns[(first + 1) % len(turns)]}
        if sock is None:
            return number, True
        message = b"c" + number.to_bytes(8, "little")
        for index in sorted(pair - {0}):
            channel = self._channels[index]
            try:
                socket.send_fds(channel, [message], [sock.fileno()])
            except BlockingIOError:  # the front is far behind in taking its connections: front 0 serves it
                pair.add(0)
            except OSError as exc:  # the front is gone; its process watch starts it again
                log.warning("front unreachable front=%d error=%s: it gets no connections", index, exc)
                with contextlib.suppress(ValueError, OSError):
                    asyncio.get_running_loop().remove_reader(channel.fileno())
                self._channels.pop(index).close()
                pair.add(0)
        return number, 0 in pair

    def take_connections(self, lane: Lane) -> None:
        """Another front: serve its copy of every connection front 0 accepts, with the lane."""
        assert self.spec is not None
        inbox = self._inbox = socket.socket(fileno=self.spec.connections)
        inbox.setblocking(False)
        asyncio.get_running_loop().add_reader(inbox.fileno(), self._arrive, lane)

    def _arrive(self, lane: Lane) -> None:
        inbox = self._inbox
        assert inbox is not None
        loop = asyncio.get_running_loop()
        try:
            message, fds, _, _ = socket.recv_fds(inbox, 16, MAX_DEALT)
        except BlockingIOError:
            return
        except OSError as exc:
            message, fds = b"", []
            log.warning("front connections channel failed front=%d error=%s", self.index, exc)
        if not message and not fds:  # front 0 closed its end: no more connections (its exit stops this front)
            loop.remove_reader(inbox.fileno())
            return
        number = int.from_bytes(message[1:9], "little") if message[:1] == b"c" and len(message) == 9 else 0
        for fd in fds:
            conn = socket.socket(fileno=fd)
            if self.sharing is not None and not self.sharing.adopt(conn):
                continue  # a socket this front holds already: parked, never closed while the first lives
            conn.setblocking(False)
            task = loop.create_task(loop.connect_accepted_socket(functools.partial(lane, number), conn))
            self._arriving.add(task)
            task.add_done_callback(self._arriving.discard)

    async def _supervise(self, port: int) -> None:
        """Start again any front that exits while the service runs."""
        while not self._stopping:
            waits = {p.exited: i for i, p in self._processes.items() if p.running}  # futures: never cancelled
            if not waits:  # none left to watch: the fork server is gone, or every restart failed
                return
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = waits[task]
                self._ready.discard(index)
                if (channel := self._channels.pop(index, None)) is not None:
                    with contextlib.suppress(ValueError, OSError):
                        asyncio.get_running_loop().remove_reader(channel.fileno())
                    channel.close()
                self.orphaned(index)  # its clients get an end at once, its unread requests another front
                if self._stopping:
                    return
                self.restarts += 1
                log.warning(
                    "front exited front=%d status=%s restarts=%d; starting it again",
                    index,
                    task.result(),
                    self.restarts,
                )
                await asyncio.sleep(RESTART_DELAY_S)
                try:
                    await self._start(index, port)
                except ServiceError as exc:
                    log.error("front not started again front=%d error=%s", index, exc)

    def stop_others(self) -> None:
        """Front 0, as it starts to drain: the other fronts drain at the same time (SIGTERM); :meth:`close`
        waits for them."""
        self._stopping = True
        for process in self._processes.values():
            process.signal(signal.SIGTERM)

    async def _stop_fronts(self) -> None:
        self.stop_others()
        try:
            if self._forking is not None:  # a fork in flight: its front is asked to stop once it is known
                await asyncio.wait([self._forking])
            waits = [p.exited for p in self._processes.values() if p.running]
            if waits:
                _, pending = await asyncio.wait(waits, timeout=self.core.config.drain_secs + STOP_TIMEOUT_S)
                for index, process in self._processes.items():
                    if process.running:
                        log.warning("front did not stop on SIGTERM front=%d pid=%d; killing it", index, process.pid)
                        process.signal(signal.SIGKILL)
                if pending:
                    await asyncio.wait(pending, timeout=STOP_TIMEOUT_S)
        finally:
            for process in self._processes.values():
                process.close()
            forks, self._forks = self._forks, None
            if forks is not None:
                with contextlib.suppress(ValueError, OSError):
                    asyncio.get_running_loop().remove_reader(forks.reports.fileno())
                await asyncio.to_thread(forks.close)  # the server sees its pipe close and leaves

    # -- another front ----------------------------------------------------------------------------

    async def _watch_parent(self) -> None:
        assert self.spec is not None
        while os.getppid() == self.spec.parent:
            await asyncio.sleep(PARENT_POLL_S)
        log.warning("front 0 is gone front=%d parent=%d: stopping", self.index, self.spec.parent)
        self._stop()
