"""KV events over NATS core: the reference's ``kv-events`` subject, relayed into the ZMQ event plane.

A worker may publish its KV events on NATS instead of a ZMQ PUB, as the reference's workers do by
default (``spec/dynamo-semantics.md`` §6.1): one ``RouterEvent`` JSON object per message
(``{"worker_id", "storage_tier", "event": {"event_id", "dp_rank", "data"}}``, the codec in
``events/codecs/dynamo.py``) on ``namespace.{ns}.component.{comp}.kv-events`` (``KV_EVENT_SUBJECT`` in the
reference's ``lib/kv-router/src/protocols.rs``; older releases spelt it ``kv_events``). An array of
records (the reference's KVBM batching publisher) is read too.

**Design: a relay, not a second plane.** :class:`NatsEventRelay` runs on the service's event loop,
subscribes to the subject, and re-sends each registered (worker, dp_rank)'s events, re-encoded as
kvrouter-format batches (``docs/wire-format.md``), on a local ZMQ PUB of that rank. The worker is then
registered with the engine as a kvrouter-format worker whose event endpoint is the relay's PUB and whose
query endpoint is the worker's own local indexer. So an applier follows a NATS worker with exactly the
code that follows a ZMQ one (``plane/stream.py``): event ids consecutive per rank, a jump is a gap,
recovered from the worker's query socket (or counted lost without one), a join restored by a dump.
Cost: one JSON decode and one msgpack encode per message in the service process, and one loopback
hop. Rejected: a NATS subscription inside each applier (nats-py is asyncio; the applier is a ZMQ poll
loop, and every applier would receive every worker's traffic) and a plane format for the reference's
JSON (a second decoder in the applier's hot path for the same events).

Bad input never stops the relay: a message that does not decode (``malformed``), one naming a worker
no one registered for NATS here (``unknown_worker``), one larger than ``max_message_bytes``
(``oversized``) is counted, logged once per kind, and dropped. A dropped message is a hole in that
worker's ids: the applier sees it as a gap at the next message and recovers it by query.

**Durable mode** (``durable=True``, fed by :class:`~kvrouter.bridge.durable.DurableEvents` from a
JetStream stream instead of a core subscription): the relay is also the *local indexer* of every rank
it reads, registered here or not (a :class:`~kvrouter.worker.local_indexer.LocalIndexer` each, the
class ``KvPublisher`` keeps its own state in), and binds a query ROUTER beside each registered rank's
PUB (:meth:`NatsEventRelay.add_query`). The engine follows such a rank with the relay's ROUTER as its
query endpoint, so an applier's join (tree dump) and gaps between the relay's PUB and the applier are
answered here: no worker is asked. Each rank's event ids are checked on the way in: an id at or below
the rank's last is a ``duplicate`` (dropped: nothing is applied twice), except id 0, a worker's new
incarnation (its state is reset, ``restarts``); an id past last + 1 is a ``gap`` (a message that never
reached the stream): counted, the rank's ring restarted so a range query across it gets a tree dump,
and the rank marked incomplete in :meth:`status`.

An incomplete rank (a gap, a first id above 0, or every rank while :attr:`NatsEventRelay.partial`: the
stream lost messages the replica needed, e.g. a snapshot that did not decode after a purge) cannot answer
for its history, so its next query is **forwarded to the worker's own query endpoint** (the one it
registered; counted ``worker_queries``): the worker's tree dump replaces the rank's state, the relay's
newer events are re-applied on top, and the relay answers the applier from the repaired state. That is
the only path on which a worker is asked in durable mode, and it is counted.

:class:`NatsEventSink` is the publishing side for :class:`~kvrouter.worker.publisher.KvPublisher`: nats-py
on a private loop on a thread of its own, fed through a queue, so the engine's step loop never awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Final

import nats
import zmq
import zmq.asyncio

from ..errors import BadEvent, ConfigError, EventError, KvRouterError
from ..events.codecs.dynamo import Decoder as DynamoDecoder
from ..events.codecs.frames import encode_live
from ..events.codecs.kvrouter import Decoder as KvrouterDecoder, Encoder as KvrouterEncoder
from ..events.codecs.query import QueryRequest, decode_reply, decode_request, encode_reply, encode_request
from ..events.model import EventBatch, KvEvent, WorkerKey
from ..worker.local_indexer import LocalIndexer
from ..worker.publisher import MAX_QUERY_BYTES
from .snapshot import RankState, compact

__all__ = [
    "MAX_MESSAGE_BYTES",
    "NatsEventRelay",
    "NatsEventSink",
    "RelayCounters",
]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES: Final = 1 << 20
"""Largest message relayed: NATS's default ``max_payload`` (1 MiB, ``spec/wire-formats.md`` §5.2)."""
RELAY_SNDHWM: Final = 100_000
"""Batches queued per applier on a relay PUB before it drops (a drop is a gap, recovered by query);
the same bound as ``KvPublisher``'s PUB."""
CONNECT_RETRY_S: Final = 1.0
"""Pause between attempts while the first connection to NATS fails."""
SINK_CONNECT_TIMEOUT_S: Final = 10.0
"""How long :class:`NatsEventSink` waits for its first connection before giving up."""
WORKER_QUERY_TIMEOUT_S: Final = 5.0
"""How long the durable relay waits for a worker's tree dump when repairing an incomplete rank."""


@dataclass(slots=True)
class RelayCounters:
    """What the relay did with each message it received."""

    received: int = 0
    forwarded: int = 0
    """Batches sent on a relay PUB (one per worker rank a message named)."""
    events: int = 0
    malformed: int = 0
    unknown_worker: int = 0
    oversized: int = 0
    duplicates: int = 0
    """Durable mode: events at or below their rank's last id, dropped (nothing is applied twice)."""
    gaps: int = 0
    """Durable mode: jumps in a rank's ids (events that never reached the stream)."""
    restarts: int = 0
    """Durable mode: a rank's ids starting again at 0 (a new worker incarnation): its state reset."""
    queries: int = 0
    """Durable mode: queries the relay's ROUTERs answered (appliers' joins and gap recoveries)."""
    bad_queries: int = 0
    worker_queries: int = 0
    """Durable mode: tree dumps asked of a worker to repair an incomplete rank (see the module docstring)."""
    worker_failures: int = 0
    """Durable mode: such asks that got no usable answer in ``WORKER_QUERY_TIMEOUT_S`` (retried at the next query)."""


class NatsEventRelay:
    """Subscribes to ``kv-events`` and re-sends each registered rank's events on its own local PUB.

    Not thread-safe: the service's event loop is its one user (``add``, ``remove``, ``relay``, ``run``).

    Args:
        url: the NATS server.
        subject: the subject to follow (``Subjects.kv_events``).
        max_message_bytes: larger messages are counted ``oversized`` and dropped.
        durable: keep a local indexer per rank and answer queries (see the module docstring); the caller
            feeds :meth:`relay` instead of running :meth:`run`.
    """

    def __init__(
        self, url: str, subject: str, *, max_message_bytes: int = MAX_MESSAGE_BYTES, durable: bool = False
    ) -> None:
        self.url = url
        self.subject = subject
        self.max_message_bytes = max_message_bytes
        self.durable = durable
        self.counters = RelayCounters()
        self.connected = False
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._async_context: zmq.asyncio.Context | None = None
        self._pubs: dict[WorkerKey, tuple[zmq.Socket[bytes], str]] = {}
        self._local: dict[WorkerKey, LocalIndexer] = {}
        """Durable mode: every rank read from the stream or a snapshot, registered here or not."""
        self._incomplete: set[WorkerKey] = set()
        """Durable mode: ranks whose ids jumped (or did not start at 0): their state misses events."""
        self._routers: dict[WorkerKey, tuple[zmq.asyncio.Socket, str, asyncio.Task[None]]] = {}
        self._fallbacks: dict[WorkerKey, str] = {}
        """Durable mode: each registered rank's own query endpoint, asked only to repair an incomplete rank."""
        self._repaired: set[WorkerKey] = set()
        self.partial = False
        """Durable mode: the stream lost messages this replica needed; every rank counts as incomplete until
        repaired from its worker (set by ``DurableEvents``)."""
        self._seq: dict[WorkerKey, int] = {}
        self._decoder = DynamoDecoder(0)
        self._encoder = KvrouterEncoder()
        self._kvrouter = KvrouterDecoder()
        self._logged: set[str] = set()
        self._nc: Any = None
        self._closed = False

    # -- registration ---------------------------------------------------------------------------

    def add(self, worker_id: int, dp_rank: int) -> str:
        """Bind (once) the local PUB that carries ``(worker_id, dp_rank)``'s events; returns its endpoint,
        which the engine subscribes to as the rank's event endpoint."""
        key = (worker_id, dp_rank)
        found = self._pubs.get(key)
        if found is not None:
            return found[1]
        sock: zmq.Socket[bytes] = self._context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, RELAY_SNDHWM)
        sock.bind("tcp://127.0.0.1:*")
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
        endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._pubs[key] = (sock, endpoint)
        self._seq[key] = 0
        log.info("nats events relay added worker=%s dp=%d endpoint=%s", worker_id, dp_rank, endpoint)
        return endpoint

    def add_query(self, worker_id: int, dp_rank: int, fallback: str | None = None) -> str:
        """Durable mode: bind (once) the query ROUTER of ``(worker_id, dp_rank)``, answered from the relay's
        local indexer of that rank on the running event loop; returns its endpoint (the engine's query
        endpoint for the rank). ``fallback``: the rank's own query endpoint, asked only to repair the rank
        when it is incomplete.

        Raises:
            ConfigError: not in durable mode.
        """
        if not self.durable:
            raise ConfigError("NatsEventRelay.add_query: the relay answers queries only in durable mode")
        key = (worker_id, dp_rank)
        if fallback is not None:
            self._fallbacks[key] = fallback
        found = self._routers.get(key)
        if found is not None:
            return found[1]
        if self._async_context is None:
            self._async_context = zmq.asyncio.Context()
        sock = self._async_context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)
        sock.bind("tcp://127.0.0.1:*")
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
        endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
        task = asyncio.get_running_loop().create_task(self._serve(key, sock), name=f"kvrouter-relay-query-{key}")
        self._routers[key] = (sock, endpoint, task)
        log.info("nats events relay answers queries worker=%s dp=%d endpoint=%s", worker_id, dp_rank, endpoint)
        return endpoint

    async def _serve(self, key: WorkerKey, sock: zmq.asyncio.Socket) -> None:
        """Answer one rank's queries from its local indexer, one at a time, until cancelled."""
        counters = self.counters
        while True:
            frames = await sock.recv_multipart()
            identity, rest = frames[0], frames[1:]
            try:
                request = decode_request(rest)
            except EventError as exc:
                counters.bad_queries += 1
                self._once("bad_query", "relay query ignored worker=%s dp=%d error=%s", key[0], key[1], exc)
                continue
            try:
                if self.incomplete(key) and key in self._fallbacks:
                    await self._repair(key)
                local = self._local.get(key) or LocalIndexer(*key)
                reply = local.answer(request)
            except (KvRouterError, ValueError) as exc:  # a rank state that will not dump: the asker times out
                self._once("answer", "relay query not answered worker=%s dp=%d error=%r", key[0], key[1], exc)
                continue
            try:
                await sock.send_multipart([identity, *encode_reply(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the peer is gone or its queue is full: it times out and asks again
                self._once("reply_dropped", "relay query reply dropped worker=%s dp=%d error=%s", key[0], key[1], exc)
                continue
            counters.queries += 1

    def incomplete(self, key: WorkerKey) -> bool:
        """Whether the rank's state may miss events (see the module docstring)."""
        return key in self._incomplete or (self.partial and key not in self._repaired)

    async def _repair(self, key: WorkerKey) -> None:
        """Replace an incomplete rank's state by its worker's tree dump, then re-apply the newer events
        relayed meanwhile. On no answer the rank stays incomplete (asked again at the next query)."""
        assert self._async_context is not None
        counters = self.counters
        counters.worker_queries += 1
        dealer = self._async_context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._fallbacks[key])
            await dealer.send_multipart(encode_request(QueryRequest(None, None)))
            try:
                frames = await asyncio.wait_for(dealer.recv_multipart(), WORKER_QUERY_TIMEOUT_S)
            except TimeoutError as exc:
                raise BadEvent(f"no answer in {WORKER_QUERY_TIMEOUT_S}s") from exc
            reply = decode_reply(frames)
            if reply.reply != "tree_dump":
                raise BadEvent(f"a full restore was answered with {reply.reply!r}")
            events = [e for payload in reply.batches for e in self._kvrouter.decode(payload).events]
        except (BadEvent, zmq.ZMQError) as exc:
            counters.worker_failures += 1
            self._once("repair", "relay could not repair rank worker=%s dp=%d error=%s", key[0], key[1], exc)
            return
        finally:
            dealer.close(linger=0)
        local = self._local.get(key)
        if local is None:
            local = self._local[key] = LocalIndexer(*key)
        newer = local.since(reply.last_event_id)
        local.load(events, reply.last_event_id)
        local.apply(newer)
        self._incomplete.discard(key)
        self._repaired.add(key)
        log.info(
            "relay repaired rank from its worker worker=%s dp=%d last=%s newer=%d",
            key[0],
            key[1],
            reply.last_event_id,
            len(newer),
        )

    def remove(self, worker_id: int, dp_ranks: Iterable[int]) -> None:
        for rank in dp_ranks:
            found = self._pubs.pop((worker_id, rank), None)
            self._seq.pop((worker_id, rank), None)
            if found is not None:
                found[0].close(linger=0)
            router = self._routers.pop((worker_id, rank), None)
            self._fallbacks.pop((worker_id, rank), None)
            if router is not None:
                router[2].cancel()
                router[0].close(linger=0)

    def follows(self, worker_id: int, dp_rank: int) -> bool:
        return (worker_id, dp_rank) in self._pubs

    # -- messages -------------------------------------------------------------------------------

    def _once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (counted, logged once)", *args)

    def relay(self, payload: bytes) -> None:
        """Handle one ``kv-events`` message: decode, group by rank, send each group as one batch."""
        counters = self.counters
        counters.received += 1
        if len(payload) > self.max_message_bytes:
            counters.oversized += 1
            self._once(
                "oversized",
                "kv-events message dropped subject=%s bytes=%d max=%d",
                self.subject,
                len(payload),
                self.max_message_bytes,
            )
            return
        try:
            batch = self._decoder.decode(payload)
        except BadEvent as exc:
            counters.malformed += 1
            self._once("malformed", "kv-events message malformed subject=%s error=%s", self.subject, exc)
            return
        groups: dict[WorkerKey, list[KvEvent]] = {}
        for event in batch.events:
            groups.setdefault((event.worker_id, event.dp_rank), []).append(event)
        for key, events in groups.items():
            if self.durable:
                events = self._index(key, events)
                if not events:
                    continue
            found = self._pubs.get(key)
            if found is None:
                if self.durable:  # kept in the rank's local indexer: relayed once it registers
                    continue
                counters.unknown_worker += 1
                self._once(
                    "unknown_worker",
                    "kv-events for a worker not registered for nats worker=%s dp=%d subject=%s",
                    key[0],
                    key[1],
                    self.subject,
                )
                continue
            seq = self._seq[key]
            self._seq[key] = seq + 1
            encoded = self._encoder.encode(EventBatch(tuple(events), time.time(), key[1]))
            try:
                found[0].send_multipart(encode_live(b"", seq, encoded), zmq.NOBLOCK, copy=False)
            except zmq.Again:  # a PUB drops rather than blocks; kept for a socket option change
                continue
            counters.forwarded += 1
            counters.events += len(events)

    def _index(self, key: WorkerKey, events: list[KvEvent]) -> list[KvEvent]:
        """Durable mode: apply a rank's events to its local indexer; the ones to relay (duplicates dropped)."""
        local = self._local.get(key)
        if local is None:
            local = self._local[key] = LocalIndexer(*key)
        counters = self.counters
        fresh: list[KvEvent] = []
        for event in events:  # hot path: one id check per event
            last = local.last_event_id
            if last is not None and event.event_id <= last:
                if event.event_id != 0:
                    counters.duplicates += 1
                    continue
                counters.restarts += 1  # a new incarnation of the worker: ids from 0 again
                local.reset()
                self._incomplete.discard(key)
                log.info("kv-events rank restarted at id 0 worker=%s dp=%d", key[0], key[1])
            elif event.event_id != (0 if last is None else last + 1):
                counters.gaps += 1
                self._incomplete.add(key)
                self._once(
                    "gap", "kv-events ids jumped worker=%s dp=%d last=%s got=%d", key[0], key[1], last, event.event_id
                )
                local.restart_ring()
            local.apply((event,))
            fresh.append(event)
        return fresh

    def clear(self) -> None:
        """Durable mode: forget every rank's state (before a snapshot load at start; sockets are kept)."""
        self._local.clear()
        self._incomplete.clear()
        self._repaired.clear()
        self.partial = False

    def load(self, ranks: Iterable[RankState]) -> None:
        """Durable mode: replace the local indexers of the ranks given by a snapshot's (the others kept)."""
        for rank in ranks:
            key = (rank.worker_id, rank.dp_rank)
            local = self._local.get(key)
            if local is None:
                local = self._local[key] = LocalIndexer(*key)
            local.load_batches(rank.batches, rank.last_event_id)
            self._incomplete.discard(key)

    def ranks(self) -> list[WorkerKey]:
        """Durable mode: every rank the relay holds state for, sorted."""
        return sorted(self._local)

    def rank_state(self, key: WorkerKey) -> RankState:
        """Durable mode: one rank's state for a snapshot, compacted (chains merged). A rank still holding the
        snapshot it was loaded from (and at most a ring of events since) gives those batches as they are:
        no dump. The caller keeps the stream from being relayed meanwhile (``DurableEvents``)."""
        local = self._local[key]
        batches = local.loaded_batches()
        if batches is None:  # hot path of a snapshot: a dump and a merge per block, on the loop
            batches = tuple(local.batches(compact(local.index.dump()), None))
        return RankState(key[0], key[1], local.last_event_id, batches)

    def local(self, worker_id: int, dp_rank: int) -> LocalIndexer | None:
        """Durable mode: the local indexer of a rank (None before its first event)."""
        return self._local.get((worker_id, dp_rank))

    async def _on_message(self, msg: Any) -> None:
        self.relay(msg.data)

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying every second until the first connection), subscribe, relay until cancelled."""
        while not self._closed:
            try:
                self._nc = await nats.connect(
                    self.url,
                    name="kvrouter-kv-events-relay",
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    connect_timeout=2,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error,
                )
                break
            except Exception as exc:  # nats-py raises OSError, NoServersError, TimeoutError ...
                self._once("connect", "kv-events relay cannot reach NATS url=%s error=%r; retrying", self.url, exc)
                await asyncio.sleep(CONNECT_RETRY_S)
        if self._nc is None:
            return
        await self._nc.subscribe(self.subject, cb=self._on_message)
        await self._nc.flush()
        self.connected = True
        log.info("kv-events relay subscribed subject=%s url=%s", self.subject, self.url)
        await asyncio.Event().wait()  # until cancelled

    async def _on_disconnected(self) -> None:
        self.connected = False
        log.warning("kv-events relay disconnected from NATS url=%s", self.url)

    async def _on_reconnected(self) -> None:
        self.connected = True
        log.info("kv-events relay reconnected url=%s", self.url)

    async def _on_error(self, exc: Exception) -> None:
        self._once(f"nats_{type(exc).__name__}", "kv-events relay NATS error=%r", exc)

    def status(self) -> dict[str, Any]:
        answer = {
            "connected": self.connected,
            "subject": self.subject,
            "workers": [list(key) for key in sorted(self._pubs)],
            **asdict(self.counters),
        }
        if self.durable:
            answer["ranks"] = len(self._local)
            answer["incomplete"] = [list(key) for key in sorted(self._local) if self.incomplete(key)]
            answer["partial"] = self.partial
        return answer

    async def close(self) -> None:
        """Drain the subscription, close the sockets and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.connected = False
        nc, self._nc = self._nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        for sock, _ in self._pubs.values():
            sock.close(linger=0)
        self._pubs.clear()
        for router, _, task in self._routers.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            router.close(linger=0)
        self._routers.clear()
        self._context.term()
        if self._async_context is not None:
            self._async_context.term()


class NatsEventSink:
    """Publishes payloads on one NATS subject from a synchronous caller, in order, never blocking it.

    nats-py runs on a private event loop on a thread of its own (start it before any fork of the
    process). :meth:`send` only hands the payload to that loop; one task publishes in order.

    Args:
        url: the NATS server.
        subject: where every payload goes (``Subjects.kv_events`` for KV events).

    Raises:
        ConfigError: the server could not be reached within ``SINK_CONNECT_TIMEOUT_S``.
    """

    sent: int
    """Payloads handed to nats-py."""
    failed: int
    """Payloads nats-py refused (connection closed, outbound buffer full while disconnected)."""
    errors: int
    """Errors nats-py reported (a failed reconnect attempt, a protocol error); each kind logged once."""

    def __init__(self, url: str, subject: str, *, connect_timeout: float = SINK_CONNECT_TIMEOUT_S) -> None:
        self.url = url
        self.subject = subject
        self.sent = 0
        self.failed = 0
        self.errors = 0
        self._logged: set[str] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[bytes | None] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvrouter-nats-sink", daemon=True)
        self._thread.start()
        if not self._ready.wait(connect_timeout) or self._error is not None:
            error = self._error
            self.close()
            raise ConfigError(f"NATS sink {url} subject {subject}: cannot connect: {error!r}")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        try:
            nc = await nats.connect(
                self.url,
                name="kvrouter-kv-publisher",
                max_reconnect_attempts=-1,
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
            )
        except Exception as exc:  # nats-py raises OSError, NoServersError, TimeoutError ...
            self._error = exc
            self._ready.set()
            return
        self._queue = queue
        self._ready.set()
        try:
            while (payload := await queue.get()) is not None:
                try:
                    await nc.publish(self.subject, payload)
                    self.sent += 1
                except Exception as exc:  # connection closed, outbound buffer full while disconnected
                    self.failed += 1
                    if self.failed == 1:
                        log.warning("nats sink publish failed subject=%s error=%r (counted)", self.subject, exc)
            with contextlib.suppress(Exception):
                await nc.flush(timeout=5)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _on_error(self, exc: Exception) -> None:
        """nats-py's errors (each failed reconnect attempt while the server is down, ...): counted, each kind
        logged once, instead of nats-py's default of a traceback per attempt."""
        self.errors += 1
        kind = type(exc).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("nats sink error subject=%s error=%r (each kind logged once, then counted)", self.subject, exc)

    async def _on_disconnected(self) -> None:
        log.warning("nats sink disconnected url=%s: publishes wait in nats-py's reconnect buffer", self.url)

    async def _on_reconnected(self) -> None:
        log.info("nats sink reconnected url=%s errors=%d", self.url, self.errors)

    def send(self, payload: bytes) -> None:
        """Queue one payload for publishing (thread-safe; returns at once)."""
        queue = self._queue
        if self._closed or queue is None:
            return
        self._loop.call_soon_threadsafe(queue.put_nowait, payload)

    def close(self) -> None:
        """Publish what is queued, flush, disconnect, end the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        queue = self._queue
        if queue is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(queue.put_nowait, None)
        self._thread.join(30)
