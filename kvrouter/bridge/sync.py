"""``ReplicaSync``: router replicas keep one view of every worker's load over NATS core.

Each ``kvrouter up`` replica books its own decisions in its partitions' slot managers, then hands the
event to :class:`ReplicaSync`, which publishes it on ``<prefix>.active_sequences_events`` (the
reference's subject and JSON, ``codec.py``); every replica subscribes there and applies the others'
AddRequest / MarkPrefillCompleted / Free to the slot manager of the worker's partition, ignoring its own
(``router_id``, a random u64 per process, as the reference's). Output-block growth is not synced, as in
the reference.

The decision path never waits on NATS: the service calls :meth:`ReplicaSync.added` and friends, which
only append a small tuple to a bounded queue (100,000 events, the reference's replica-sync channel
capacity; when full the newest event is dropped and counted, never blocking the decision). One task
encodes and publishes. Rejected: publishing from the request handler (an await per decision, and a slow
NATS would slow routing) and a thread (the slot managers are not thread-safe; everything here runs on
the service's loop).

Bad input never stops the sync: a payload that does not decode, a request id already active, a Free or
MarkPrefillCompleted for an id nobody booked is counted by kind and logged once per kind.

**Late join.** The reference starts a replica from zero. kvrouter's joining replica first subscribes to
the events (buffering them), then asks a peer for a snapshot: a request on ``<prefix>.
kvrouter_active_sequences_snapshot`` that every running replica answers with its router id (the first
answer wins; no answer means no peer), then a request to ``<that subject>.<router_id>``, answered by that
peer alone with its every active request (its own and those it learnt) as AddRequest events in parts
under NATS's 1 MiB payload limit, each with the request's remaining prefill tokens. The joiner applies
the parts, then the buffered events in order (an AddRequest already in the snapshot counts as a
duplicate; a Free of a snapshot request frees it), then goes live. A request for a worker the joiner has
not registered yet (live or from the snapshot) is kept, updated by later events, and applied when the
worker registers; kept requests expire like the others.

**Expiry.** A replica that dies without freeing leaves its requests on the others; they go at the slot
managers' expiry (``--router-active-request-expiry-secs``), swept by the service's health loop. A
request learnt from a snapshot starts its age at the join, so it may outlive its original by up to the
joiner's start time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any, Final, Protocol

import nats
import nats.errors
import numpy as np
import orjson

from ..errors import BadMessage, DuplicateRequest
from ..events.model import WorkerKey
from ..routing.slots import Booked, SlotManager
from .codec import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
    Data,
    decode_event,
    decode_snapshot_part,
    encode_event,
    split_snapshot,
)
from .subjects import Subjects

__all__ = ["QUEUE_CAPACITY", "ReplicaSync", "SyncCounters", "SyncHost"]

log = logging.getLogger(__name__)

QUEUE_CAPACITY: Final = 100_000
"""Events waiting to be published; the reference's ``REPLICA_EVENT_CHANNEL_CAPACITY``."""
SNAPSHOT_PART_BYTES: Final = 512 * 1024
"""A snapshot part's payload bound: half of NATS's default 1 MiB ``max_payload``."""
JOIN_TIMEOUT_S: Final = 2.0
"""How long a joiner waits for a peer's answer, then for each snapshot part."""
CONNECT_RETRY_S: Final = 1.0
"""Pause between attempts while the first connection to NATS fails."""
CLOSE_FLUSH_S: Final = 2.0
"""On close, how long queued events are given to reach the server."""


class SyncHost(Protocol):
    """What the sync needs of the service: the slot manager a worker's load lives in, all of them, and a
    word when a peer changed a worker's load."""

    def slots_of(self, worker: WorkerKey) -> SlotManager | None:
        """The slot manager of the worker's partition; None when the worker is not registered."""
        ...

    def all_slots(self) -> Iterable[SlotManager]: ...

    def synced(self, worker: WorkerKey, request_id: str, kind: str) -> None:
        """A peer's ``kind`` (``AddRequest``, ``MarkPrefillCompleted``, ``Free``) changed ``worker``'s load."""
        ...


@dataclass(slots=True)
class SyncCounters:
    """What the sync counts (``/metrics`` ``kvrouter_replica_sync_*``, ``/ready``)."""

    published: int = 0
    applied: int = 0
    """Peers' events applied (live, from the buffer, or from a snapshot)."""
    ignored_own: int = 0
    malformed: int = 0
    unknown_worker: int = 0
    """AddRequests for a worker not registered here: kept until it registers."""
    duplicate: int = 0
    """AddRequests for a request id already active here."""
    unknown_request: int = 0
    """Free / MarkPrefillCompleted for a request id not active here."""
    dropped: int = 0
    """Own events dropped because the publish queue was full, or publishing failed."""
    snapshot_received: int = 0
    """Requests received in a peer's snapshot at join (applied at once, or kept for their worker)."""
    snapshots_served: int = 0
    expired_pending: int = 0
    """Kept requests (unknown worker) dropped at expiry before their worker registered."""


_Queued = tuple[str, WorkerKey, tuple[Booked, bool] | str, str | None]
"""(request_id, worker, data, lora_name), encoded by the publisher task; data is "Free",
"MarkPrefillCompleted", or for an AddRequest what the slot manager holds and whether it tracks blocks
(the hashes become JSON off the decision path)."""


def _add_request(booked: Booked, tracked: bool) -> AddRequest:
    """The AddRequest of a booked request: its hashes (random stand-ins for blocks of its own under
    ``assume_kv_reuse=False``, as the reference), its remaining prefill tokens as the hint."""
    hashes: tuple[int, ...] | None = None
    if len(booked.hashes):
        hashes = tuple(booked.hashes.tolist())
    elif booked.blocks:
        hashes = tuple(secrets.randbits(64) for _ in range(booked.blocks))
    elif tracked:
        hashes = ()
    return AddRequest(hashes, booked.prefill_tokens)


class ReplicaSync:
    """One replica's end of the sync. Built by the service when ``--router-replica-sync`` is on.

    Args:
        url: the NATS server (``nats://host:port``).
        subjects: the (namespace, component) subjects.
        host: the service (see :class:`SyncHost`).
        expiry_secs: how long a request for an unregistered worker is kept.
        router_id: this replica's id; a random u64 by default.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        url: str,
        subjects: Subjects,
        host: SyncHost,
        *,
        expiry_secs: float,
        router_id: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.subjects = subjects
        self.host = host
        self.expiry_secs = expiry_secs
        self.router_id = secrets.randbits(64) if router_id is None else router_id
        self.counters = SyncCounters()
        self._clock = clock
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue(maxsize=QUEUE_CAPACITY)
        self._pending: dict[str, tuple[ActiveSequenceEvent, float]] = {}
        """Peers' requests for workers not registered here, oldest first, with when they came."""
        self._buffer: list[bytes] | None = []
        """Live payloads held while the snapshot is fetched; None once live."""
        self._logged: set[str] = set()
        self._nc: Any = None
        self._subs: list[Any] = []
        self._publisher: asyncio.Task[None] | None = None
        self.joined = False
        """The join is done (snapshot applied, or no peer): the view is as complete as the sync can make it."""
        self.peer: int | None = None
        """The router id whose snapshot this replica joined from, if any."""
        self._closing = False
        self._closed = asyncio.Event()
        self._snapshot_ids: set[str] = set()
        """While the events buffered during the join are replayed: the ids the snapshot held."""

    # -- status ---------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        nc = self._nc
        return bool(nc is not None and nc.is_connected)

    def status(self) -> dict[str, Any]:
        """``/ready``'s and ``/metrics``' view: connected, joined, the router id and the counters."""
        return {
            "connected": self.connected,
            "joined": self.joined,
            "router_id": self.router_id,
            "subject": self.subjects.active_sequences,
            "peer": self.peer,
            "pending": len(self._pending),
            "queued": self._queue.qsize(),
            **asdict(self.counters),
        }

    def _once(self, kind: str, message: str, *args: object) -> None:
        """Log the first event of a kind; the counters tell the rest."""
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (logged once; see kvrouter_replica_sync_events)", *args)

    # -- own events (the decision path: no await, no I/O) ---------------------------------------

    def _enqueue(self, item: _Queued) -> None:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.counters.dropped += 1
            self._once("dropped", "replica sync queue full capacity=%d: newest event dropped", QUEUE_CAPACITY)

    def added(self, request_id: str, slots: SlotManager, lora_name: str | None = None) -> None:
        """The service booked ``request_id`` in ``slots``: publish what it holds (AddRequest)."""
        booked = slots.booked(request_id)  # its hashes array is the slot manager's own, never changed
        if booked is not None:
            self._enqueue((request_id, booked.worker, (booked, slots.track_active_blocks), lora_name))

    def prefill_completed(self, request_id: str, worker: WorkerKey) -> None:
        self._enqueue((request_id, worker, MARK_PREFILL_COMPLETED, None))

    def freed(self, request_id: str, worker: WorkerKey) -> None:
        self._enqueue((request_id, worker, FREE, None))

    def locate(self, request_id: str) -> tuple[SlotManager, WorkerKey] | None:
        """Where a request active here (a peer's, say) lives: so any replica can free any reservation."""
        for slots in self.host.all_slots():
            booked = slots.booked(request_id)
            if booked is not None:
                return slots, booked.worker
        return None

    async def _publish(self, nc: Any) -> None:
        """The one task that encodes and publishes own events, in order."""
        queue = self._queue
        while True:
            request_id, worker, data, lora = await queue.get()
            try:
                event_data: Data
                if isinstance(data, str):
                    event_data = FREE if data == FREE else MARK_PREFILL_COMPLETED
                else:
                    event_data = _add_request(*data)
                payload = encode_event(ActiveSequenceEvent(request_id, worker, event_data, self.router_id, lora))
                await nc.publish(self.subjects.active_sequences, payload)
                self.counters.published += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nats-py: outbound buffer full while disconnected, connection closed
                self.counters.dropped += 1
                self._once("publish", "replica sync publish failed error=%r", exc)
            finally:
                queue.task_done()

    # -- peers' events --------------------------------------------------------------------------

    async def _on_event(self, msg: Any) -> None:
        if self._buffer is not None:
            self._buffer.append(msg.data)
            return
        self.apply(msg.data)

    def apply(self, payload: bytes) -> None:
        """Apply one ``active_sequences_events`` payload (a peer's; own ones are counted and skipped)."""
        try:
            event = decode_event(payload)
        except BadMessage as exc:
            self.counters.malformed += 1
            self._once("malformed", "replica sync malformed message error=%s", exc)
            return
        if event.router_id == self.router_id:
            self.counters.ignored_own += 1
            return
        self._apply_event(event)

    def _apply_event(self, event: ActiveSequenceEvent) -> None:
        data = event.data
        if isinstance(data, AddRequest):
            self._add(event, data)
            return
        kept = self._pending.get(event.request_id)
        if kept is not None:  # a request for a worker not registered yet
            if data == FREE:
                del self._pending[event.request_id]
            else:
                add = kept[0].data
                assert isinstance(add, AddRequest)
                self._pending[event.request_id] = (replace(kept[0], data=replace(add, prefill_tokens=0)), kept[1])
            self.counters.applied += 1
            return
        slots = self.host.slots_of(event.worker)
        booked = slots.booked(event.request_id) if slots is not None else None
        if slots is None or booked is None or booked.worker != event.worker:
            self.counters.unknown_request += 1
            self._once(
                "unknown_request",
                "replica sync %s for a request not active here request_id=%s",
                data,
                event.request_id,
            )
            return
        if data == FREE:
            slots.free(event.request_id)
        else:
            slots.mark_prefill_completed(event.request_id)
        self.counters.applied += 1
        self.host.synced(event.worker, event.request_id, str(data))

    def _add(self, event: ActiveSequenceEvent, add: AddRequest) -> bool:
        """Book a peer's request; kept for later when its worker is not registered here."""
        if event.request_id in self._pending:
            self._duplicate(event)
            return False
        slots = self.host.slots_of(event.worker)
        if slots is None:
            self.counters.unknown_worker += 1
            self._once(
                "unknown_worker",
                "replica sync request for an unregistered worker, kept until it registers worker_id=%d dp_rank=%d",
                *event.worker,
            )
            self._pending[event.request_id] = (event, self._clock())
            return False
        hashes = np.array(add.token_sequence or (), dtype=np.uint64)
        tokens = add.prefill_tokens if add.track_prefill_tokens and add.prefill_tokens is not None else 0
        try:
            slots.add_request(event.request_id, event.worker, hashes, tokens, 0)
        except DuplicateRequest:
            self._duplicate(event)
            return False
        self.counters.applied += 1
        self.host.synced(event.worker, event.request_id, "AddRequest")
        return True

    def _duplicate(self, event: ActiveSequenceEvent) -> None:
        if event.request_id in self._snapshot_ids:
            return
        self.counters.duplicate += 1
        self._once("duplicate", "replica sync AddRequest for a request already active request_id=%s", event.request_id)

    def worker_registered(self, worker: WorkerKey) -> None:
        """The service registered ``worker``: book the requests kept for it."""
        if not self._pending:
            return
        for request_id, (event, _) in list(self._pending.items()):
            if event.worker == worker:
                del self._pending[request_id]
                assert isinstance(event.data, AddRequest)
                self._add(event, event.data)

    def sweep(self) -> int:
        """Drop kept requests (unknown worker) older than the expiry; returns how many."""
        expiry = self._clock() - self.expiry_secs
        expired = [rid for rid, (_, at) in self._pending.items() if at <= expiry]
        for request_id in expired:
            del self._pending[request_id]
        self.counters.expired_pending += len(expired)
        return len(expired)

    # -- snapshot ---------------------------------------------------------------------------------

    def snapshot_events(self) -> list[ActiveSequenceEvent]:
        """Every request active here and every kept one, as AddRequests with their remaining prefill."""
        events: list[ActiveSequenceEvent] = []
        for slots in self.host.all_slots():
            for request_id in slots.request_ids():
                booked = slots.booked(request_id)
                if booked is None:
                    continue
                add = _add_request(booked, slots.track_active_blocks)
                events.append(ActiveSequenceEvent(request_id, booked.worker, add, self.router_id))
        events.extend(event for event, _ in self._pending.values())
        return events

    async def _on_hello(self, msg: Any) -> None:
        with contextlib.suppress(orjson.JSONDecodeError, TypeError, AttributeError):
            if orjson.loads(msg.data).get("router_id") == self.router_id:
                return
        await msg.respond(orjson.dumps({"router_id": self.router_id}))

    async def _on_snapshot(self, msg: Any) -> None:
        nc = self._nc
        if not msg.reply or nc is None:
            return
        parts = split_snapshot(self.router_id, self.snapshot_events(), SNAPSHOT_PART_BYTES)
        for part in parts:
            await nc.publish(msg.reply, part)
        self.counters.snapshots_served += 1
        log.info("replica sync snapshot served parts=%d to=%s", len(parts), msg.reply)

    async def _join(self) -> None:
        """Ask a peer for its view and apply it, then the events buffered meanwhile; then go live."""
        nc = self._nc
        try:
            hello = await nc.request(
                self.subjects.snapshot, orjson.dumps({"router_id": self.router_id}), timeout=JOIN_TIMEOUT_S
            )
            peer = orjson.loads(hello.data)["router_id"]
            if type(peer) is not int:
                raise TypeError(f"router_id {peer!r}")
        except nats.errors.NoRespondersError:
            peer = None
        except (nats.errors.TimeoutError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
            log.warning("replica sync join: no usable peer answer error=%r; starting from the live events", exc)
            peer = None
        got: dict[int, tuple[ActiveSequenceEvent, ...]] = {}
        if peer is not None:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            try:
                await nc.publish(self.subjects.snapshot_of(peer), b"{}", reply=inbox)
                parts = 1
                while len(got) < parts:
                    try:
                        msg = await sub.next_msg(timeout=JOIN_TIMEOUT_S)
                        part = decode_snapshot_part(msg.data)
                    except nats.errors.TimeoutError:
                        log.warning("replica sync join: snapshot incomplete peer=%d parts=%d/%d", peer, len(got), parts)
                        break
                    except BadMessage as exc:
                        self.counters.malformed += 1
                        self._once("malformed_snapshot", "replica sync malformed snapshot part error=%s", exc)
                        continue
                    parts = part.parts
                    got[part.part] = part.events
                for index in sorted(got):
                    for event in got[index]:
                        assert isinstance(event.data, AddRequest)
                        self.counters.snapshot_received += 1
                        self._add(event, event.data)
                self.peer = peer
            finally:
                await sub.unsubscribe()
        buffered, self._buffer = self._buffer or [], None
        self._snapshot_ids = {e.request_id for events in got.values() for e in events}
        for payload in buffered:  # an AddRequest the snapshot already held is expected here, not a duplicate
            self.apply(payload)
        self._snapshot_ids = set()
        self.joined = True
        log.info(
            "replica sync joined router_id=%d peer=%s snapshot_received=%d buffered=%d",
            self.router_id,
            peer,
            self.counters.snapshot_received,
            len(buffered),
        )

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying while the server is unreachable), subscribe, join, then publish until
        cancelled. nats-py reconnects by itself after the first connection."""
        while self._nc is None and not self._closing:
            try:
                self._nc = await nats.connect(
                    servers=[self.url],
                    name=f"kvrouter-{self.router_id}",
                    connect_timeout=2,
                    reconnect_time_wait=0.5,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._once("connect", "replica sync cannot reach NATS url=%s error=%r; retrying", self.url, exc)
                await asyncio.sleep(CONNECT_RETRY_S)
        nc = self._nc
        if nc is None:
            return
        log.info(
            "replica sync connected url=%s router_id=%d subject=%s",
            self.url,
            self.router_id,
            self.subjects.active_sequences,
        )
        self._subs.append(await nc.subscribe(self.subjects.active_sequences, cb=self._on_event))
        self._publisher = asyncio.create_task(self._publish(nc), name="kvrouter-sync-publish")
        await self._join()
        self._subs.append(await nc.subscribe(self.subjects.snapshot, cb=self._on_hello))
        self._subs.append(await nc.subscribe(self.subjects.snapshot_of(self.router_id), cb=self._on_snapshot))
        await self._closed.wait()

    async def close(self) -> None:
        """Give queued events a moment to go out, then close the connection; :meth:`run` returns. Call it
        before cancelling :meth:`run`'s task. Idempotent."""
        self._closing = True
        self._closed.set()
        nc, self._nc = self._nc, None
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            if nc is not None and nc.is_connected and self._queue.qsize():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._queue.join(), CLOSE_FLUSH_S)
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.flush(timeout=CLOSE_FLUSH_S)
            with contextlib.suppress(Exception):
                await nc.close()
        self._subs.clear()

    async def _on_error(self, exc: Exception) -> None:
        self._once(f"error:{type(exc).__name__}", "replica sync NATS error error=%r", exc)

    async def _on_disconnected(self) -> None:
        log.warning("replica sync disconnected url=%s", self.url)

    async def _on_reconnected(self) -> None:
        log.info("replica sync reconnected url=%s", self.url)
