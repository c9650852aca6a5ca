"""``KvPublisher``: what an engine embeds to publish its KV cache in kvrouter's format and answer recovery.

The engine calls :meth:`~KvPublisher.store` when it registers full blocks, :meth:`~KvPublisher.remove`
when it evicts them, :meth:`~KvPublisher.clear` when it resets its prefix cache, and
:meth:`~KvPublisher.publish` once per step. The publisher computes the blocks' local hashes (so the
router never re-hashes tokens), numbers events consecutively from 0, and sends each step as one live
message ``[topic, seq, payload]`` on a PUB socket (``docs/wire-format.md``). It also keeps a *local
indexer* (:class:`~kvrouter.worker.local_indexer.LocalIndexer`, as Dynamo's ``LocalKvIndexer``,
``spec/dynamo-semantics.md`` §6.1): a ring of the last ``buffer_events`` events plus every block the
worker holds, and answers a router's range queries on a ROUTER socket
(:mod:`kvrouter.events.codecs.query`): ``events`` for a range still in the ring, ``tree_dump`` for a
full restore or a range older than the ring, ``too_new`` past the last id. The same class is the
durable-mode relay's per-rank state (``bridge/events.py``): one way to hold and answer it.

Rejected: vLLM's replay protocol (a ring of raw batches keyed by seq). It cannot answer "older than I
keep" with anything but silence, so a router that fell behind by more than the ring could never catch
up without a restart of the engine.

**NATS.** Given a ``nats`` sink (:class:`~kvrouter.bridge.events.NatsEventSink` on the reference's
``kv-events`` subject), every published event also goes out there as one ``RouterEvent`` JSON object,
the reference's message (``docs/nats-bridge.md``, "Events over NATS"); range queries are still answered
on the ZMQ query socket. A JSON block is about 70 bytes against msgpack's 16, so with a sink an event
holds at most :data:`NATS_EVENT_BLOCKS` blocks, keeping each message under NATS's 1 MiB ``max_payload``;
the ring and the ZMQ batches carry the same (smaller) events, so ids agree on both transports.

Threads: a ``KvPublisher`` is **not thread-safe**. One thread owns it (ZMQ sockets must not be shared
between threads either): the engine's step loop calls ``store``/``remove``/``clear``/``publish`` and
also ``serve`` to answer pending queries, e.g. ``serve(0)`` once per step and ``serve(timeout)`` while
idle. A query is answered between steps, so a reply is always a consistent state.

Bad queries (garbage frames, wrong version, unknown op) are counted in :attr:`KvPublisher.bad_queries`,
logged once, and **ignored without a reply**: the requester times out as it would for a dead worker,
which is the path it must handle anyway; an error reply would be a fourth reply kind every router has
to know. Frames larger than :data:`MAX_QUERY_BYTES` never reach Python: ZMQ drops the connection of
the peer that sent them (``ZMQ_MAXMSGSIZE``).

Example: wiring it into an engine's block manager (allocate / evict hooks) and step loop::

    from kvrouter import KvPublisher

    pub = KvPublisher(worker_id=7, block_size=16, endpoint="tcp://*:5557", query_endpoint="tcp://*:5558")

    def on_blocks_allocated(block_ids, token_ids, parent_block_id):  # full blocks just registered
        pub.store(block_ids, token_ids, parent=parent_block_id)

    def on_blocks_evicted(block_ids):
        pub.remove(block_ids)

    def on_prefix_cache_reset():
        pub.clear()

    while running:
        engine.step()  # calls the hooks above
        pub.publish()  # one batch per step; nothing is sent when the step changed nothing
        pub.serve(timeout_ms=0)  # answer any recovery query between steps
    pub.close()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt
import zmq

from ..errors import ConfigError, EncodeError, EngineError, EventError, InvalidHashInput
from ..events.codecs.dynamo import Encoder as RouterEventEncoder
from ..events.codecs.frames import encode_live
from ..events.codecs.query import QueryReply, QueryRequest, decode_request, encode_reply
from ..events.model import (
    U64_MAX,
    Cleared,
    EngineHash,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
)
from ..hashing import block_hashes
from ..index.reference import RadixIndex
from .local_indexer import BUFFER_EVENTS, MAX_BATCH_BYTES, LocalIndexer

__all__ = [
    "BUFFER_EVENTS",
    "MAX_BATCH_BYTES",
    "MAX_EVENT_BLOCKS",
    "MAX_QUERY_BYTES",
    "NATS_EVENT_BLOCKS",
    "EventSink",
    "KvPublisher",
]

log = logging.getLogger(__name__)

MAX_EVENT_BLOCKS: Final = 32_768
"""Blocks per event: a store or remove of more is split into consecutive events (a store's later
parts chained under the previous part's last block), so one event packs to at most ~512 KiB and
always fits a batch of :data:`MAX_BATCH_BYTES`."""

NATS_EVENT_BLOCKS: Final = 8_192
"""Blocks per event when publishing on NATS too: a stored block is at most 71 JSON bytes, so an event
is at most ~580 KiB, under NATS's default 1 MiB ``max_payload``. Pinned by
tests/bridge/test_events_nats.py::test_big_store_fits_nats."""

MAX_QUERY_BYTES: Final = 64 << 10
"""``ZMQ_MAXMSGSIZE`` of the query ROUTER. A request is under 50 bytes; anything larger is not a
request, and ZMQ disconnects its sender before Python sees it."""

PUB_SNDHWM: Final = 100_000
"""Live messages queued per subscriber before the PUB drops: vLLM's publisher ``hwm``
(``spec/wire-formats.md`` §1.5). A drop shows up at the router as a seq gap, recovered by query."""

MAX_QUERIES_PER_SERVE: Final = 64
"""``serve`` answers at most this many queries per call, so a flood cannot stall the engine's step."""


def _engine_hash(value: int, where: str) -> EngineHash:
    """An engine's block id as u64: signed i64 ids (two's complement) fold as the codecs fold them."""
    value = int(value)
    if not -(1 << 63) <= value <= U64_MAX:
        raise InvalidHashInput(f"{where}: engine hash {value} does not fit in 64 bits")
    return EngineHash(value & U64_MAX)


class EventSink(Protocol):
    """Where a publisher sends each event's ``RouterEvent`` JSON besides ZMQ (e.g. ``NatsEventSink``)."""

    def send(self, payload: bytes) -> None: ...


class KvPublisher:
    """Publishes one (worker, dp_rank)'s KV events and answers the router's recovery queries.

    A new instance, or :meth:`reset`, is a new publisher incarnation: event ids and seq start at 0,
    the ring and the block set are empty. Not thread-safe: see the module docstring.

    Args:
        worker_id: the worker the blocks belong to (u64).
        block_size: tokens per block; ``store`` hashes full blocks of this size.
        endpoint: where the PUB binds, e.g. ``tcp://*:5557`` (``tcp://127.0.0.1:*`` picks a free port;
            read the bound address from :attr:`endpoint`).
        query_endpoint: where the query ROUTER binds; None serves no queries.
        dp_rank: the data-parallel rank every event carries.
        topic: the first frame of every live message (SUB sockets prefix-filter on it).
        buffer_events: events the ring keeps for range answers.
        context: a ZMQ context to make the sockets in; by default the publisher makes its own and
            terminates it on :meth:`close`.
        nats: also publish every event, as one reference ``RouterEvent`` JSON per message, through this
            sink (the caller owns and closes it).

    Raises:
        ConfigError: ``block_size`` or ``buffer_events`` below 1, or an endpoint that cannot be bound.
    """

    bad_queries: int
    """Query messages that were not a valid request (ignored, no reply)."""
    queries_answered: int
    """Queries answered on the query socket since the start: what a test counts to show that a router
    restored or recovered without asking this worker (durable mode, ``docs/nats-bridge.md``)."""

    def __init__(
        self,
        worker_id: int,
        *,
        block_size: int,
        endpoint: str,
        query_endpoint: str | None = None,
        dp_rank: int = 0,
        topic: bytes = b"",
        buffer_events: int = BUFFER_EVENTS,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        nats: EventSink | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"KvPublisher block_size must be >= 1, got {block_size}")
        if buffer_events < 1:
            raise ConfigError(f"KvPublisher buffer_events must be >= 1, got {buffer_events}")
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.topic = topic
        self.buffer_events = buffer_events
        self.bad_queries = 0
        self.queries_answered = 0
        self._nats = nats
        self._router_events = RouterEventEncoder()
        self._event_blocks = MAX_EVENT_BLOCKS if nats is None else NATS_EVENT_BLOCKS
        self._logged: set[str] = set()
        self._closed = False
        self._local = LocalIndexer(worker_id, dp_rank, buffer_events=buffer_events)
        self._pending: list[KvEvent] = []
        self._next_event_id = 0
        self._next_seq = 0
        self._own_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if context is None else context
        self._router: zmq.Socket[bytes] | None = None
        self._pub = self._bind(zmq.PUB, endpoint, "endpoint")
        self.endpoint: str = self._last_endpoint(self._pub)
        """The address the PUB is bound to (the port resolved when ``endpoint`` used ``*``)."""
        self.query_endpoint: str | None = None
        """The address the query ROUTER is bound to, or None without one."""
        if query_endpoint is not None:
            self._router = self._bind(zmq.ROUTER, query_endpoint, "query_endpoint")
            self.query_endpoint = self._last_endpoint(self._router)

    def _bind(self, kind: int, endpoint: str, name: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:  # before bind: a pipe takes the HWM in force when its peer connects
            sock.setsockopt(zmq.SNDHWM, PUB_SNDHWM)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self.close()
            raise ConfigError(f"KvPublisher worker {self.worker_id} {name} {endpoint!r}: cannot bind: {exc}") from exc
        return sock

    @staticmethod
    def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
        value = sock.getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    # -- what the engine calls ------------------------------------------------------------------

    def store(
        self,
        engine_hashes: Sequence[int],
        token_ids: Sequence[int] | npt.NDArray[np.uint32],
        *,
        parent: int | None = None,
        tier: StorageTier = StorageTier.DEVICE,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue one Stored event: ``engine_hashes`` are the engine's ids of the blocks just registered,
        in prefix order under ``parent`` (None at the root); ``token_ids`` their tokens, concatenated;
        ``lora_name`` and ``cache_salt`` the request's, hashed into the blocks as the router hashes them.

        Local hashes are computed here (full blocks only: a partial tail of ``token_ids`` is ignored).
        A store of more than :data:`MAX_EVENT_BLOCKS` blocks is queued as several chained events; a
        store of no blocks queues nothing.

        Raises:
            EncodeError: the tokens do not make exactly one full block per engine hash.
            InvalidHashInput: an engine hash outside 64 bits, or a token id outside u32.
        """
        engine = [_engine_hash(h, f"store engine_hashes[{i}]") for i, h in enumerate(engine_hashes)]
        local = block_hashes(token_ids, self.block_size, lora_name=lora_name, cache_namespace=cache_salt)
        if len(local) != len(engine):
            raise EncodeError(
                f"KvPublisher worker {self.worker_id} store: {len(engine)} engine hashes but "
                f"{len(token_ids)} tokens make {len(local)} full blocks of {self.block_size}"
            )
        above = None if parent is None else _engine_hash(parent, "store parent")
        for start in range(0, len(engine), self._event_blocks):
            stop = start + self._event_blocks
            blocks = tuple(
                StoredBlock(e, LocalHash(h)) for e, h in zip(engine[start:stop], local[start:stop], strict=True)
            )
            self._queue(
                Stored(self.worker_id, above, blocks, dp_rank=self.dp_rank, event_id=self._take_id(), tier=tier)
            )
            above = blocks[-1].engine_hash

    def remove(self, engine_hashes: Sequence[int], *, tier: StorageTier = StorageTier.DEVICE) -> None:
        """Queue one Removed event for blocks the engine evicted (split past :data:`MAX_EVENT_BLOCKS`;
        nothing for an empty list).

        Raises:
            InvalidHashInput: an engine hash outside 64 bits.
        """
        engine = [_engine_hash(h, f"remove engine_hashes[{i}]") for i, h in enumerate(engine_hashes)]
        for start in range(0, len(engine), self._event_blocks):
            chunk = tuple(engine[start : start + self._event_blocks])
            self._queue(Removed(self.worker_id, chunk, dp_rank=self.dp_rank, event_id=self._take_id(), tier=tier))

    def clear(self, *, tier: StorageTier = StorageTier.DEVICE) -> None:
        """Queue one Cleared event: every block of ``tier`` is gone (a prefix-cache reset)."""
        self._queue(Cleared(self.worker_id, dp_rank=self.dp_rank, event_id=self._take_id(), tier=tier))

    def _take_id(self) -> int:
        event_id = self._next_event_id
        self._next_event_id += 1
        return event_id

    def _queue(self, event: KvEvent) -> None:
        self._pending.append(event)

    def publish(self, *, send: bool = True) -> int | None:
        """Turn the queued events into one step's batch: apply them to the local indexer and the ring,
        and send them as ``[topic, seq, payload]``.

        A step whose events pack to more than :data:`MAX_BATCH_BYTES` goes out as several batches with
        consecutive seqs; with a ``nats`` sink each event also goes there as one message.
        ``send=False`` is a fault-injection hook: the batch is applied and its seq spent, but nothing
        is sent (on either transport), as if lost on the wire; a router recovers it by query.

        Returns:
            The seq of the (last) batch, or None when nothing was queued.

        Raises:
            EngineError: the publisher is closed.
        """
        self._check_open()
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        self._local.apply(events)
        timestamp = time.time()
        seq = self._next_seq
        for payload in self._local.batches(events, timestamp):
            seq = self._next_seq
            self._next_seq += 1
            if send:
                self._pub.send_multipart(encode_live(self.topic, seq, payload), copy=False)
        if send and self._nats is not None:
            for event in events:  # one RouterEvent per message, as the reference's publisher sends them
                self._nats.send(self._router_events.encode_router_event(event))
        return seq

    def serve(self, timeout_ms: int = 0) -> int:
        """Answer queries waiting on the query socket, waiting up to ``timeout_ms`` for the first.

        Answers at most :data:`MAX_QUERIES_PER_SERVE` per call; bad queries are counted and ignored.

        Returns:
            How many queries were answered (0 without a query endpoint).

        Raises:
            EngineError: the publisher is closed.
        """
        self._check_open()
        router = self._router
        if router is None:
            return 0
        if timeout_ms > 0 and not router.poll(timeout_ms, zmq.POLLIN):
            return 0
        answered = 0
        for _ in range(MAX_QUERIES_PER_SERVE):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            identity, rest = frames[0], frames[1:]
            try:
                request = decode_request(rest)
            except EventError as exc:
                self.bad_queries += 1
                self._log_once(
                    "bad_query",
                    "bad query ignored worker=%s dp=%d error=%s (counted, logged once)",
                    self.worker_id,
                    self.dp_rank,
                    exc,
                )
                continue
            reply = self.answer(request)
            try:
                router.send_multipart([identity, *encode_reply(reply)], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:  # the peer's queue is full or it is gone: it will time out
                self._log_once(
                    "reply_dropped", "query reply dropped worker=%s dp=%d error=%s", self.worker_id, self.dp_rank, exc
                )
                continue
            answered += 1
        self.queries_answered += answered
        return answered

    def answer(self, request: QueryRequest) -> QueryReply:
        """The reply to one query, as :meth:`serve` sends it (exposed for engines with their own transport)."""
        return self._local.answer(request)

    def reset(self) -> None:
        """An engine restart: queued events dropped, local indexer and ring emptied, event ids and seq
        back to 0. The router sees the seq go back to 0 and treats the worker as fresh."""
        self._local.reset()
        self._pending.clear()
        self._next_event_id = 0
        self._next_seq = 0

    @property
    def last_event_id(self) -> int | None:
        """The id of the last published event (None before the first publish of this incarnation)."""
        return self._local.last_event_id

    @property
    def index(self) -> RadixIndex:
        """The local indexer's block set (read it, never apply to it): what a tree dump rebuilds."""
        return self._local.index

    @property
    def index_errors(self) -> int:
        """Events the local indexer refused (an unknown parent, an unknown removed block, a repeated hash).
        They are still published: the router refuses them alike, so both sides agree."""
        return self._local.index_errors

    # -- lifecycle ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"KvPublisher of worker {self.worker_id} dp {self.dp_rank} is closed")

    def _log_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message, *args)

    def close(self) -> None:
        """Close both sockets at once (unsent messages are dropped: linger 0) and the context if the
        publisher made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sock in (getattr(self, "_pub", None), self._router):
            if sock is not None:
                sock.close(linger=0)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> KvPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
