"""``LocalIndexer``: one (worker, dp_rank)'s block set and recent events, and the answer to a range query.

Dynamo's ``LocalKvIndexer`` (``spec/dynamo-semantics.md`` §6.1) lives in the worker: a ring of the last
``WORKER_KV_INDEXER_BUFFER_SIZE`` events plus every block the worker holds, so a router that missed
events asks the worker rather than restarting. kvrouter has two holders of that state: the worker's
:class:`~kvrouter.worker.publisher.KvPublisher`, and in durable mode the service's
:class:`~kvrouter.bridge.events.NatsEventRelay`, which keeps one per rank it reads off the JetStream
stream so that an applier's gap or join is answered inside the service and no worker is asked
(``docs/nats-bridge.md``, "Durable mode"). This class is that state and its query answer, once, for both.

The block set is a :class:`~kvrouter.index.reference.RadixIndex` fed the very events the router gets,
so its dump is by construction what the router would hold had it seen everything (interior evictions
included). Cost: one Python object per cached block; the reference index is the oracle every other index
is checked against, so a dump from it needs no checking of its own.

Answers (:mod:`kvrouter.events.codecs.query`): ``events`` for a range still in the ring, ``tree_dump``
for a full restore or a range older than the ring, ``too_new`` past the last id. Events the block set
refuses (an unknown parent, ...) are counted in :attr:`LocalIndexer.index_errors` and kept in the ring:
the router refuses them alike, so both sides agree.

Not thread-safe: its owner (the engine's step loop, or the service's event loop) is its one user.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Final

from ..errors import ConfigError, EventError
from ..events.codecs.kvrouter import Decoder, Encoder
from ..events.codecs.query import QueryReply, QueryRequest
from ..events.model import Cleared, EventBatch, KvEvent, Removed, Stored
from ..index.reference import RadixIndex

__all__ = ["BUFFER_EVENTS", "MAX_BATCH_BYTES", "LocalIndexer"]

log = logging.getLogger(__name__)

BUFFER_EVENTS: Final = 1024
"""Events the ring keeps for range answers: Dynamo's ``WORKER_KV_INDEXER_BUFFER_SIZE``
(``spec/dynamo-semantics.md`` §6.1)."""

MAX_BATCH_BYTES: Final = 1 << 20
"""No batch payload, live or inside a reply, exceeds 1 MiB: a larger step goes out as several
consecutive batches (each its own seq), a larger reply as several batches in its list. A router may
set its SUB's ``ZMQ_MAXMSGSIZE`` from it. Pinned by tests/worker/test_publisher.py::test_big_steps_split."""

_BATCH_OVERHEAD: Final = 128
"""Upper bound of a batch's msgpack bytes besides its events (map keys, version, ids, timestamp)."""


def event_bytes(event: KvEvent) -> int:
    """Upper bound of one event's packed size without tokens (tag, id, tier, parent, bin headers)."""
    match event:
        case Stored(blocks=blocks):
            return 64 + 16 * len(blocks)
        case Removed(engine_hashes=hashes):
            return 48 + 8 * len(hashes)
        case Cleared():
            return 32


class LocalIndexer:
    """One (worker, dp_rank)'s block set, ring of recent events and last event id.

    Args:
        worker_id: the worker whose events this holds.
        dp_rank: its data-parallel rank (every reply batch carries it).
        buffer_events: events the ring keeps for range answers.

    Raises:
        ConfigError: ``buffer_events`` below 1.
    """

    index_errors: int
    """Events the block set refused (still kept in the ring: the router refuses them alike)."""

    def __init__(self, worker_id: int, dp_rank: int = 0, *, buffer_events: int = BUFFER_EVENTS) -> None:
        if buffer_events < 1:
            raise ConfigError(f"LocalIndexer buffer_events must be >= 1, got {buffer_events}")
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.buffer_events = buffer_events
        self.index_errors = 0
        self._encoder = Encoder()
        self._index = RadixIndex()
        self._ring: deque[KvEvent] = deque(maxlen=buffer_events)
        self._last_event_id: int | None = None
        self._logged: set[str] = set()
        self._base: tuple[bytes, ...] | None = None
        """Batches loaded by :meth:`load_batches` and not yet applied to the block set (lazy)."""
        self._after_base: list[KvEvent] = []
        """Events applied since ``_base`` was loaded, while it is still lazy."""

    def apply(self, events: Sequence[KvEvent]) -> None:
        """Apply events (consecutive ids, continuing :attr:`last_event_id`) to the block set and the ring."""
        if not events:
            return
        if self._base is not None:  # lazy: the block set is built when first needed
            self._after_base.extend(events)
            self._ring.extend(events)
            self._last_event_id = events[-1].event_id
            if len(self._after_base) > self.buffer_events:
                self._materialize()
            return
        for event in events:  # hot path: one index update per event
            try:
                self._index.apply_event(self.worker_id, event)
            except EventError as exc:
                self.index_errors += 1
                if exc.kind not in self._logged:
                    self._logged.add(exc.kind)
                    log.warning(
                        "local index refused event worker=%s dp=%d kind=%s error=%s (counted, logged once)",
                        self.worker_id,
                        self.dp_rank,
                        exc.kind,
                        exc,
                    )
        self._ring.extend(events)
        self._last_event_id = events[-1].event_id

    def restart_ring(self) -> None:
        """Forget the ring (the block set stays): the next events do not continue the ring's ids, so a
        range query from before them must get a tree dump, never a range with a hole in it."""
        self._ring.clear()

    def load_batches(self, batches: Sequence[bytes], last_event_id: int | None) -> None:
        """Replace the state by a dump as kvrouter batches (a snapshot's) reflecting ``last_event_id``, lazily.

        The batches are kept as they are: a tree dump is answered with them followed by the events applied
        since (both rebuild the rank from empty, in order), so a join after a warm restart costs no block
        in Python. The block set is built from them only when something needs it (:attr:`index`, a
        snapshot, more than ``buffer_events`` events since). The caller checked the batches decode.
        """
        self.load((), last_event_id)
        self._base = tuple(batches)

    def _materialize(self) -> None:
        """Build the block set from the lazy batches and the events since."""
        base, after = self._base, self._after_base
        if base is None:
            return
        self._base, self._after_base = None, []
        decoder = Decoder()
        for payload in base:
            for event in decoder.decode(payload).events:
                try:
                    self._index.apply_event(self.worker_id, event)
                except EventError:
                    self.index_errors += 1
        ring, last = list(self._ring), self._last_event_id
        self.apply(after)
        self._ring.clear()
        self._ring.extend(ring)
        self._last_event_id = last

    def load(self, events: Iterable[KvEvent], last_event_id: int | None) -> None:
        """Replace the state by a dump's events (a snapshot, a worker's tree dump) reflecting ``last_event_id``.

        The ring starts empty: any range query older than the next event gets a tree dump.
        """
        self._base, self._after_base = None, []
        self._index = RadixIndex()
        self._ring.clear()
        for event in events:
            try:
                self._index.apply_event(self.worker_id, event)
            except EventError:
                self.index_errors += 1
        self._last_event_id = last_event_id

    def since(self, event_id: int | None) -> list[KvEvent]:
        """The ring's events after ``event_id`` (all of them for None), in order."""
        return [e for e in self._ring if event_id is None or e.event_id > event_id]

    def reset(self) -> None:
        """A new incarnation of the worker (its ids start at 0 again): everything emptied."""
        self._base, self._after_base = None, []
        self._index = RadixIndex()
        self._ring.clear()
        self._last_event_id = None

    def answer(self, request: QueryRequest) -> QueryReply:
        """The reply to one query (``kvrouter.events.codecs.query``)."""
        last = self._last_event_id
        if request.start is None:
            return self.tree_dump()
        after = -1 if last is None else last
        if request.start > after + 1:
            return QueryReply("too_new", last)
        first = self._ring[0].event_id if self._ring else after + 1
        if request.start < first:
            return self.tree_dump()
        end = after if request.end is None else min(request.end, after)
        wanted = list(itertools.islice(self._ring, request.start - first, max(end - first + 1, 0)))
        return QueryReply("events", last, tuple(self.batches(wanted, None)))

    def loaded_batches(self) -> tuple[bytes, ...] | None:
        """While a :meth:`load_batches` is still lazy: its batches and the events since, which rebuild the
        rank from empty (what a new snapshot of it may hold without a dump); else None."""
        if self._base is None:
            return None
        return self._base + tuple(self.batches(self._after_base, None))

    def tree_dump(self) -> QueryReply:
        """A ``tree_dump`` reply: events rebuilding the block set from empty (the lazy batches and the events
        since, or the block set's dump)."""
        loaded = self.loaded_batches()
        if loaded is not None:
            return QueryReply("tree_dump", self._last_event_id, loaded)
        return QueryReply("tree_dump", self._last_event_id, tuple(self.batches(self._index.dump(), None)))

    def batches(self, events: Iterable[KvEvent], timestamp: float | None) -> Iterable[bytes]:
        """Pack events into kvrouter-format batch payloads of at most :data:`MAX_BATCH_BYTES` each, in order."""
        group: list[KvEvent] = []
        size = _BATCH_OVERHEAD
        for event in events:
            cost = event_bytes(event)
            if group and size + cost > MAX_BATCH_BYTES:
                yield self._encoder.encode(EventBatch(tuple(group), timestamp, self.dp_rank))
                group, size = [], _BATCH_OVERHEAD
            group.append(event)
            size += cost
        if group:
            yield self._encoder.encode(EventBatch(tuple(group), timestamp, self.dp_rank))

    @property
    def last_event_id(self) -> int | None:
        """The id of the last event applied or loaded (None when empty and never fed)."""
        return self._last_event_id

    @property
    def index(self) -> RadixIndex:
        """The block set (read it, never apply to it): what a tree dump rebuilds."""
        self._materialize()
        return self._index
