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

**Faults: re-sync.** NATS core keeps nothing: what a replica misses while its connection is down, or
what nats-py drops when a subscription's pending queue overflows (a slow consumer), is gone, and what it
published into a dead connection may never have reached anyone. So after a reconnect, a slow consumer,
or an own event dropped, a replica *re-syncs*: it buffers the live events again, asks a peer for a
snapshot exactly as at the join, and reconciles. The snapshot carries each request's *origin* (the
router id that booked it) and the peer's *tombstones* (ids freed there within the expiry, as Free
events), so the rules are local: a peer's request held here but not in the snapshot is freed here; one
in the snapshot but not here is booked; a completed prefill wins either way (taken over here, or its
MarkPrefillCompleted published again). An own request is the owner's to announce: one the peer lacks
is published again (AddRequest), one the peer tombstoned is freed here (its Free was missed); a request
the peer still holds but this replica freed (or, an own one, expired) gets its Free published again.
Then the buffered events are applied and the replica goes live. ``/ready`` says ``replica sync
re-syncing (<why>)`` meanwhile; ``disconnects``, ``reconnects``, ``slow_consumer`` (one per message
nats-py dropped), ``resyncs`` and ``resync_added / resync_freed / resync_updated / resync_republished``
(each a lost message's effect, corrected) count what happened. Rejected: per-router sequence numbers to
detect gaps (a field the reference's event has not; a gap says something was lost, not what) and
JetStream for the sync (the reference keeps the sync on core NATS; the durable mode is for KV events).
The limit: a re-sync sees one peer's view, so with three or more replicas a request the chosen peer
never learnt (and whose owner does not re-sync) is freed here, and this replica under-counts it until
it ends (its Free then counts ``unknown_request``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
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
PUBLISH_BATCH: Final = 1024
"""Own events the publisher takes off its queue per wake-up, at most."""
CLOSE_FLUSH_S: Final = 2.0
"""On close, how long queued events are given to reach the server."""
PRESENCE_INTERVAL_S: Final = 2.0
"""How often a replica announces itself on the presence subject. A peer is counted while it was heard
within three intervals; the sync lag is the median, over those peers, of their last announcement's
one-way delay (its ``time.time()`` stamp against ours: across hosts this includes the clocks' offset)."""
PING_INTERVAL_S: Final = 2.0
MAX_OUTSTANDING_PINGS: Final = 3
"""A server that answers no ping for about ``PING_INTERVAL_S * MAX_OUTSTANDING_PINGS`` (a paused or
partitioned server) is a lost connection: reconnect, then re-sync. nats-py's default (120 s x 2) would
hide a pause of minutes."""
TOMBSTONES: Final = QUEUE_CAPACITY
"""Recently freed request ids kept for a peer's re-sync (also bounded by the expiry)."""
PENDING_MSGS_ENV: Final = "KVROUTER_SYNC_PENDING_MSGS_LIMIT"
"""Test-only: the events subscription's pending-message limit (nats-py's default, 524,288, otherwise);
a small one provokes a slow consumer."""


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

    def own_requests(self) -> Collection[str]:
        """The ids of the reservations this replica booked itself and still holds."""
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
    disconnects: int = 0
    """Times the connection to NATS was lost (what peers sent meanwhile is lost: a re-sync follows)."""
    reconnects: int = 0
    slow_consumer: int = 0
    """Peers' messages nats-py dropped because the subscription's pending queue was full."""
    resyncs: int = 0
    """Re-syncs started (after a reconnect, a slow consumer, an own event dropped), retries included."""
    resync_added: int = 0
    """Peers' requests booked by a re-sync: their AddRequest was lost."""
    resync_freed: int = 0
    """Requests freed by a re-sync: a Free was lost (or the peer never had them)."""
    resync_updated: int = 0
    """Peers' requests whose prefill a re-sync marked completed: the MarkPrefillCompleted was lost."""
    resync_republished: int = 0
    """Own events a re-sync published again because the peer lacked them (AddRequest, Free, completion)."""


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


def _remaining(event: ActiveSequenceEvent) -> int:
    """A snapshot AddRequest's remaining prefill tokens (0 when not tracked)."""
    add = event.data
    assert isinstance(add, AddRequest)
    return add.prefill_tokens if add.track_prefill_tokens and add.prefill_tokens is not None else 0


class ReplicaSync:
    """One replica's end of the sync. Built by the service when ``--router-replica-sync`` is on.

    Args:
        url: the NATS server (``nats://host:port``).
        subjects: the (namespace, component) subjects.
        host: the service (see :class:`SyncHost`).
        expiry_secs: how long a request for an unregistered worker is kept.
        router_id: this replica's id; a random u64 by default.
        clock: seconds, monotonic.
        pending_msgs_limit: the events subscription's pending-message limit; nats-py's default unless
            given here or in ``KVROUTER_SYNC_PENDING_MSGS_LIMIT`` (test-only: a small one provokes a slow
            consumer).
        connect: ``nats.connect``, or :func:`~kvrouter.bridge.localbus.connect` for the fronts of one
            ``kvrouter up`` without a NATS server (``url`` is then the local bus's ``ipc://`` endpoint).
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
        pending_msgs_limit: int | None = None,
        connect: Callable[..., Awaitable[Any]] = nats.connect,
    ) -> None:
        self.url = url
        self._connect = connect
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
        self._origin: dict[str, tuple[int, float]] = {}
        """Peers' requests held here (or kept): who booked them and when they came, oldest first."""
        self._freed: dict[str, tuple[WorkerKey, float]] = {}
        """Tombstones: ids freed here (by anyone) within the expiry, oldest first, at most ``TOMBSTONES``."""
        self.resyncing: str | None = None
        """Why this replica's view may be incomplete until the running re-sync ends; None when live."""
        self._resync_task: asyncio.Task[None] | None = None
        self._resync_again = False
        self._peers: dict[int, tuple[float, float]] = {}
        """Router id -> (when its last presence came, on our clock; its one-way delay [s])."""
        self._announcer: asyncio.Task[None] | None = None
        limit = os.environ.get(PENDING_MSGS_ENV)
        if pending_msgs_limit is None and limit:
            pending_msgs_limit = int(limit)
        self._pending_msgs_limit = pending_msgs_limit

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
            "resyncing": self.resyncing,
            "router_id": self.router_id,
            "subject": self.subjects.active_sequences,
            "peer": self.peer,
            "pending": len(self._pending),
            "queued": self._queue.qsize(),
            **self.presence(),
            **asdict(self.counters),
        }

    def presence(self) -> dict[str, Any]:
        """``peers``: the other replicas heard within three presence intervals; ``sync_lag_ms``: the median of
        their last one-way delays, None without peers."""
        now = self._clock()
        lags = sorted(lag for seen, lag in self._peers.values() if now - seen <= 3 * PRESENCE_INTERVAL_S)
        return {"peers": len(lags), "sync_lag_ms": lags[len(lags) // 2] * 1e3 if lags else None}

    async def _announce(self, nc: Any) -> None:
        """Say we are here every ``PRESENCE_INTERVAL_S`` (a failed publish is retried at the next tick)."""
        payload = {"router_id": self.router_id}
        while True:
            with contextlib.suppress(Exception):
                await nc.publish(self.subjects.presence, orjson.dumps({**payload, "sent_at": time.time()}))
            await asyncio.sleep(PRESENCE_INTERVAL_S)

    async def _on_presence(self, msg: Any) -> None:
        try:
            body = orjson.loads(msg.data)
            router_id, sent_at = int(body["router_id"]), float(body["sent_at"])
        except (ValueError, TypeError, KeyError) as exc:
            self.counters.malformed += 1
            self._once("presence", "replica sync malformed presence message error=%r", exc)
            return
        if router_id != self.router_id:
            self._peers[router_id] = (self._clock(), max(0.0, time.time() - sent_at))

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
            self._request_resync("own events dropped")

    def added(self, request_id: str, slots: SlotManager, lora_name: str | None = None) -> None:
        """The service booked ``request_id`` in ``slots``: publish what it holds (AddRequest)."""
        booked = slots.booked(request_id)  # its hashes array is the slot manager's own, never changed
        if booked is not None:
            self._enqueue((request_id, booked.worker, (booked, slots.track_active_blocks), lora_name))

    def prefill_completed(self, request_id: str, worker: WorkerKey) -> None:
        self._enqueue((request_id, worker, MARK_PREFILL_COMPLETED, None))

    def freed(self, request_id: str, worker: WorkerKey) -> None:
        self._tombstone(request_id, worker)
        self._enqueue((request_id, worker, FREE, None))

    def _tombstone(self, request_id: str, worker: WorkerKey) -> None:
        self._origin.pop(request_id, None)
        freed = self._freed
        freed.pop(request_id, None)
        if len(freed) >= TOMBSTONES:
            del freed[next(iter(freed))]
        freed[request_id] = (worker, self._clock())

    def locate(self, request_id: str) -> tuple[SlotManager, WorkerKey] | None:
        """Where a request active here (a peer's, say) lives: so any replica can free any reservation."""
        for slots in self.host.all_slots():
            booked = slots.booked(request_id)
            if booked is not None:
                return slots, booked.worker
        return None

    async def _publish(self, nc: Any) -> None:
        """The one task that encodes and publishes own events, in order: every event queued by the time it
        wakes, not one per wake-up (on a loop busy with requests, each wake-up waits its turn behind them,
        so one event a turn fell behind at a few thousand decisions a second)."""
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while len(batch) < PUBLISH_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            for request_id, worker, data, lora in batch:
                try:
                    event_data: Data
                    if isinstance(data, str):
                        event_data = FREE if data == FREE else MARK_PREFILL_COMPLETED
                    else:
                        event_data = _add_request(*data)
                    event = ActiveSequenceEvent(request_id, worker, event_data, self.router_id, lora)
                    await nc.publish(self.subjects.active_sequences, encode_event(event))
                    self.counters.published += 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # nats-py: outbound buffer full while disconnected, connection closed
                    self.counters.dropped += 1
                    self._once("publish", "replica sync publish failed error=%r", exc)
                    self._request_resync("own events dropped")
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
                self._tombstone(event.request_id, event.worker)
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
            self._tombstone(event.request_id, event.worker)
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
            self._set_origin(event)
            return False
        hashes = np.array(add.token_sequence or (), dtype=np.uint64)
        tokens = add.prefill_tokens if add.track_prefill_tokens and add.prefill_tokens is not None else 0
        try:
            slots.add_request(event.request_id, event.worker, hashes, tokens, 0)
        except DuplicateRequest:
            self._duplicate(event)
            return False
        self.counters.applied += 1
        self._set_origin(event)
        self.host.synced(event.worker, event.request_id, "AddRequest")
        return True

    def _set_origin(self, event: ActiveSequenceEvent) -> None:
        self._origin.pop(event.request_id, None)
        self._origin[event.request_id] = (event.router_id, self._clock())

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
        for table in (self._origin, self._freed):  # both oldest first: O(expired)
            while table:
                oldest = next(iter(table))
                if table[oldest][1] > expiry:
                    break
                del table[oldest]
        return len(expired)

    # -- snapshot ---------------------------------------------------------------------------------

    def snapshot_events(self) -> list[ActiveSequenceEvent]:
        """Every request active here and every kept one, as AddRequests with their remaining prefill, each
        with the router id that booked it; then the tombstones, as Frees."""
        events: list[ActiveSequenceEvent] = []
        origin = self._origin
        for slots in self.host.all_slots():
            for request_id in slots.request_ids():
                booked = slots.booked(request_id)
                if booked is None:
                    continue
                add = _add_request(booked, slots.track_active_blocks)
                router_id = origin[request_id][0] if request_id in origin else self.router_id
                events.append(ActiveSequenceEvent(request_id, booked.worker, add, router_id))
        events.extend(event for event, _ in self._pending.values())
        freed = self._freed.items()
        events.extend(ActiveSequenceEvent(rid, worker, FREE, self.router_id) for rid, (worker, _) in freed)
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

    async def _fetch_snapshot(self) -> tuple[int | None, list[ActiveSequenceEvent], bool]:
        """Ask a peer for its view: (its router id or None when no replica answers, its events, whether the
        snapshot came whole). A peer that answers the hello but not the snapshot (or not the whole of it)
        gives an incomplete one."""
        nc = self._nc
        try:
            hello = await nc.request(
                self.subjects.snapshot, orjson.dumps({"router_id": self.router_id}), timeout=JOIN_TIMEOUT_S
            )
            peer = orjson.loads(hello.data)["router_id"]
            if type(peer) is not int:
                raise TypeError(f"router_id {peer!r}")
        except nats.errors.NoRespondersError:
            return None, [], True
        except (nats.errors.TimeoutError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
            self._once("no_peer_answer", "replica sync snapshot: no usable peer answer error=%r", exc)
            return None, [], False
        got: dict[int, tuple[ActiveSequenceEvent, ...]] = {}
        parts = 1
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(self.subjects.snapshot_of(peer), b"{}", reply=inbox)
            while len(got) < parts:
                try:
                    msg = await sub.next_msg(timeout=JOIN_TIMEOUT_S)
                    part = decode_snapshot_part(msg.data)
                except nats.errors.TimeoutError:
                    log.warning("replica sync snapshot incomplete peer=%d parts=%d/%d", peer, len(got), parts)
                    break
                except BadMessage as exc:
                    self.counters.malformed += 1
                    self._once("malformed_snapshot", "replica sync malformed snapshot part error=%s", exc)
                    continue
                parts = part.parts
                got[part.part] = part.events
        finally:
            with contextlib.suppress(Exception):  # the connection may be gone again
                await sub.unsubscribe()
        return peer, [event for index in sorted(got) for event in got[index]], len(got) == parts

    def _replay(self, events: list[ActiveSequenceEvent]) -> int:
        """Go live: apply the events buffered while the snapshot was fetched (an AddRequest the snapshot
        already held is expected there, not a duplicate). Returns how many."""
        buffered, self._buffer = self._buffer or [], None
        self._snapshot_ids = {e.request_id for e in events if isinstance(e.data, AddRequest)}
        for payload in buffered:
            self.apply(payload)
        self._snapshot_ids = set()
        return len(buffered)

    async def _join(self) -> None:
        """Ask a peer for its view and apply it, then the events buffered meanwhile; then go live."""
        peer, events, _ = await self._fetch_snapshot()  # an incomplete snapshot is better than none here
        for event in events:
            if isinstance(event.data, AddRequest):  # the Frees are the peer's tombstones: nothing here yet
                self.counters.snapshot_received += 1
                self._add(event, event.data)
        self.peer = peer if peer is not None else self.peer
        buffered = self._replay(events)
        self.joined = True
        log.info(
            "replica sync joined router_id=%d peer=%s snapshot_received=%d buffered=%d",
            self.router_id,
            peer,
            self.counters.snapshot_received,
            buffered,
        )

    # -- faults: re-sync ------------------------------------------------------------------------------

    def _request_resync(self, reason: str) -> None:
        """Re-sync soon (one at a time; a request while one runs makes it run once more). Cheap: nats-py
        calls it from its read loop, once per dropped message."""
        if self._closing:
            return
        if self.resyncing is None:
            self.resyncing = reason
        task = self._resync_task
        if (task is not None and not task.done()) or not self.joined or not self.connected:
            self._resync_again = True  # the running one, the join or the reconnect starts it
            return
        self._resync_task = asyncio.create_task(self._resync_loop(), name="kvrouter-sync-resync")

    async def _resync_loop(self) -> None:
        while not self._closing:
            self._resync_again = False
            try:
                done = await self._resync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nats-py: the connection went again, a timeout
                done = False
                self._once("resync_failed", "replica sync re-sync failed error=%r; retrying", exc)
            if self._resync_again:
                continue
            if done:
                break
            if not self.connected:
                return  # the reconnect starts it again; /ready keeps saying why
            await asyncio.sleep(CONNECT_RETRY_S)
        self.resyncing = None

    async def _resync(self) -> bool:
        """Buffer the live events, fetch a peer's snapshot, reconcile, go live. False when the snapshot did
        not come whole (nothing reconciled: freeing what a partial snapshot lacks would be wrong)."""
        self.counters.resyncs += 1
        log.info("replica sync re-sync reason=%s resyncs=%d", self.resyncing, self.counters.resyncs)
        if self._buffer is None:
            self._buffer = []
        events: list[ActiveSequenceEvent] = []
        try:
            peer, events, whole = await self._fetch_snapshot()
            if not whole:
                return False
            if peer is not None:
                self._reconcile(events)
                self.peer = peer
            return True
        finally:
            self._replay(events)

    def _reconcile(self, events: list[ActiveSequenceEvent]) -> None:
        """Make this replica's view the peer's for the peers' requests, and tell the peers what they
        missed of this replica's own (see the module docstring)."""
        adds = {e.request_id: e for e in events if isinstance(e.data, AddRequest)}
        frees = {e.request_id for e in events if e.data == FREE}
        own = set(self.host.own_requests())
        held: set[str] = set()
        counters = self.counters
        for slots in list(self.host.all_slots()):
            for request_id in slots.request_ids():
                booked = slots.booked(request_id)
                if booked is None:
                    continue
                held.add(request_id)
                theirs = adds.get(request_id)
                if theirs is None:
                    if request_id not in own or request_id in frees:
                        # a peer's request the peer does not hold (its Free was lost, or it never was
                        # there), or an own one the peer freed (its Free was lost): freed here too
                        self._free_here(slots, request_id, booked.worker)
                    else:  # an own request the peer never learnt
                        self._republish((request_id, booked.worker, (booked, slots.track_active_blocks), None))
                elif booked.prefill_tokens > 0 and _remaining(theirs) == 0:  # a completion lost on the way here
                    slots.mark_prefill_completed(request_id)
                    counters.resync_updated += 1
                    self.host.synced(booked.worker, request_id, MARK_PREFILL_COMPLETED)
                elif booked.prefill_tokens == 0 and _remaining(theirs) > 0:  # one lost on the way there
                    self._republish((request_id, booked.worker, MARK_PREFILL_COMPLETED, None))
        for request_id in list(self._pending):  # peers' requests kept for unregistered workers
            if request_id not in adds:
                del self._pending[request_id]
                self._origin.pop(request_id, None)
                counters.resync_freed += 1
        for request_id, event in adds.items():
            if request_id in held or request_id in self._pending:
                continue
            if request_id in self._freed or event.router_id == self.router_id:
                # freed here (or an own one expired here) and the peer missed the Free
                self._republish((request_id, event.worker, FREE, None))
            else:
                assert isinstance(event.data, AddRequest)
                self._add(event, event.data)
                counters.resync_added += 1
        log.info(
            "replica sync reconciled added=%d freed=%d updated=%d republished=%d",
            counters.resync_added,
            counters.resync_freed,
            counters.resync_updated,
            counters.resync_republished,
        )

    def _free_here(self, slots: SlotManager, request_id: str, worker: WorkerKey) -> None:
        slots.free(request_id)
        self._tombstone(request_id, worker)
        self.counters.resync_freed += 1
        self.host.synced(worker, request_id, FREE)

    def _republish(self, item: _Queued) -> None:
        self.counters.resync_republished += 1
        self._enqueue(item)

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying while the server is unreachable), subscribe, join, then publish until
        cancelled. nats-py reconnects by itself after the first connection."""
        while self._nc is None and not self._closing:
            try:
                self._nc = await self._connect(
                    servers=[self.url],
                    name=f"kvrouter-{self.router_id}",
                    connect_timeout=2,
                    reconnect_time_wait=0.5,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    ping_interval=PING_INTERVAL_S,
                    max_outstanding_pings=MAX_OUTSTANDING_PINGS,
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
        limits = {} if self._pending_msgs_limit is None else {"pending_msgs_limit": self._pending_msgs_limit}
        self._subs.append(await nc.subscribe(self.subjects.active_sequences, cb=self._on_event, **limits))
        self._publisher = asyncio.create_task(self._publish(nc), name="kvrouter-sync-publish")
        await self._join()
        self._subs.append(await nc.subscribe(self.subjects.snapshot, cb=self._on_hello))
        self._subs.append(await nc.subscribe(self.subjects.snapshot_of(self.router_id), cb=self._on_snapshot))
        self._subs.append(await nc.subscribe(self.subjects.presence, cb=self._on_presence))
        self._announcer = asyncio.create_task(self._announce(nc), name="kvrouter-sync-presence")
        if self._resync_again:  # a fault during the join
            self._request_resync(self.resyncing or "a fault during the join")
        await self._closed.wait()

    async def close(self) -> None:
        """Give queued events a moment to go out, then close the connection; :meth:`run` returns. Call it
        before cancelling :meth:`run`'s task. Idempotent."""
        self._closing = True
        self._closed.set()
        nc, self._nc = self._nc, None
        publisher, self._publisher = self._publisher, None
        resync, self._resync_task = self._resync_task, None
        announcer, self._announcer = self._announcer, None
        if announcer is not None:
            announcer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await announcer
        if resync is not None:
            resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await resync
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
        if isinstance(exc, nats.errors.SlowConsumerError):  # one per message nats-py dropped
            self.counters.slow_consumer += 1
            self._once("slow_consumer", "replica sync slow consumer: a peer's message dropped subject=%s", exc.subject)
            self._request_resync("slow consumer: peers' messages dropped")
            return
        self._once(f"error:{type(exc).__name__}", "replica sync NATS error error=%r", exc)

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        self.counters.disconnects += 1
        if self.resyncing is None:
            self.resyncing = "NATS connection lost"
        log.warning("replica sync disconnected url=%s disconnects=%d", self.url, self.counters.disconnects)

    async def _on_reconnected(self) -> None:
        self.counters.reconnects += 1
        log.info("replica sync reconnected url=%s reconnects=%d", self.url, self.counters.reconnects)
        self._request_resync("NATS connection lost")
