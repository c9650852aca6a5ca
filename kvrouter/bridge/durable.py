"""JetStream durable mode: workers' ``kv-events`` kept in a stream, each replica a durable consumer, snapshots.

``--router-durable-kv-events`` (``spec/dynamo-semantics.md`` §6.4, ``docs/nats-bridge.md`` "Durable
mode"). Workers publish exactly as for NATS core (``kv-events``, the reference's ``RouterEvent`` JSON);
the stream ``namespace-{ns}-component-{comp}-kv-events`` (the reference's name: the subject slugged)
captures that subject, created with file storage by the first replica that finds it missing. Each
replica reads it through its own durable pull consumer ``kvrouter-<router_id>`` and hands every message
to its :class:`~kvrouter.bridge.events.NatsEventRelay` in durable mode, which keeps a local indexer per
rank and answers the appliers' queries itself (``events.py``): no worker is asked, neither on a join
nor for a gap, unless the stream lost part of a rank's history (then that rank is repaired from its
worker once, counted).

**Restart: snapshot + stream, not the consumer's cursor.** A replica's index lives in its memory, so a
restarted replica has lost everything its consumer had acknowledged; resuming the consumer where it
stopped would skip exactly what it needs. At start it therefore loads the snapshot (if any), then
re-creates its consumer (same durable name: found again, not a new one per restart) to deliver from the
snapshot's stream sequence + 1. The snapshot is taken while no message is being relayed, so the
sequence it records is exactly the last one its state reflects: the replay neither misses nor repeats a
message, and per-rank event ids drop anything delivered twice anyway (a redelivery after a reconnect is
dropped by the stream cursor, ``redelivered``). ``/ready`` waits until the replica has processed the
stream up to its last sequence at start (or the consumer has nothing pending). What the durable
consumer buys while running: the server keeps the cursor across NATS disconnects and server restarts
(a core subscription would lose what was published meanwhile), and its ack floor tells the snapshot
taker how far every live replica has read (below). A clean stop deletes it (as the reference's shutdown
does); a killed replica's is replaced by its next start, or removed by the server after an hour unused.
Rejected: an ephemeral consumer per start (a killed replica would leave one behind per restart, each
holding back the purge for its inactivity hour) and persisting the index locally (a second durable store
to keep consistent with the stream, on a machine that may not come back).

**Snapshots.** Every second (± 100 ms jitter, as the reference) a caught-up replica checks the stream;
at ``snapshot_threshold`` messages or more, and holding the lock ``router-snapshot-lock`` (a key created
only if absent in the key-value bucket of the same name as the object store bucket,
``namespace-{ns}-component-{comp}-radix-bucket``; it expires after ``LOCK_TTL_S`` if its holder dies;
the reference uses an etcd lock, which kvrouter does not have), it uploads its relay's state
(``snapshot.py``: compact msgpack, not one JSON event per block) as the object ``radix-state``, then
purges the stream below the smaller of the snapshot's sequence and every consumer's ack floor, so a live
replica that lags never loses a message it has not read. The reference purges first and dumps after (its
comment admits the dump may not match the purge point); dumping first makes the recorded sequence exact.
The dump holds a lock the consumer also takes around each fetched batch, so no message is relayed while
it runs, and it yields to the event loop between two ranks: HTTP requests wait for one rank's dump at
most, not for the whole index (a million blocks take seconds to dump in Python).

**Loading.** The object is read until two consecutive reads of its metadata agree around a successful
read of its data (same ``nuid``, at most ``SNAPSHOT_READ_TRIES`` tries ``SNAPSHOT_READ_PAUSE_S`` apart):
the reference's "read until two consecutive reads agree" applied to the metadata, so a 20 MB snapshot is
downloaded once, not twice (nats-py's object get is the slow part, ``spec/wire-formats.md`` §5.2), and the
data's SHA-256 is checked by nats-py. An object that does not decode is counted (``snapshot_bad``), logged
as an error naming the bucket, and the replica replays the stream from its first message instead; when
the stream was purged past that (``first_seq`` beyond the resume point) the relay is marked ``partial``
and each rank is repaired from its worker at its first query. A snapshot ahead of the stream's last
sequence (the stream was made again) is refused the same way.

``--router-reset-states`` deletes the snapshot bucket (and its lock bucket) and purges the stream at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Final

import nats
import nats.errors
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError, ObjectNotFoundError

from ..errors import BadMessage
from .events import NatsEventRelay
from .snapshot import decode_snapshot, encode_snapshot
from .subjects import Subjects

__all__ = [
    "LOCK_KEY",
    "SNAPSHOT_OBJECT",
    "DurableCounters",
    "DurableEvents",
    "bucket_name",
    "consumer_name",
    "slug",
    "stream_name",
]

log = logging.getLogger(__name__)

SNAPSHOT_OBJECT: Final = "radix-state"
"""The reference's ``RADIX_STATE_FILE``."""
LOCK_KEY: Final = "router-snapshot-lock"
"""The reference's ``ROUTER_SNAPSHOT_LOCK``."""
BUCKET_SUFFIX: Final = "radix-bucket"
"""The reference's ``RADIX_STATE_BUCKET``."""
LOCK_TTL_S: Final = 60.0
"""A lock whose holder died expires after this (the lock bucket's max age)."""
CHECK_INTERVAL_S: Final = 1.0
CHECK_JITTER_S: Final = 0.1
"""The reference checks the stream every second; the jitter keeps replicas from asking in step."""
SNAPSHOT_READ_TRIES: Final = 10
SNAPSHOT_READ_PAUSE_S: Final = 0.1
"""The reference's download loop: up to 10 reads, 100 ms apart, until two agree."""
FETCH_BATCH: Final = 256
"""Messages per pull request: enough to amortise the round trip, small enough to keep the loop fair."""
FETCH_WAIT_S: Final = 0.5
"""How long one pull request waits for a message when the stream has none pending."""
ACK_WAIT_S: Final = 30.0
"""Unacknowledged messages are redelivered after this (dropped again by the stream cursor)."""
CONSUMER_INACTIVE_S: Final = 3600.0
"""A consumer nobody pulled from for this long is removed by the server: the reference's docs give
durable consumers an hour. Until then a stopped replica's ack floor holds back the purge."""
MAX_ACK_PENDING: Final = 100_000
"""Messages fetched and not yet acknowledged before the server stops delivering (acks are per batch)."""
RETRY_S: Final = 1.0
"""Pause before retrying after NATS refused or dropped a request."""
CLOSE_TIMEOUT_S: Final = 2.0
"""Bound on deleting the consumer at shutdown (NATS may be gone)."""
START_TRIES: Final = 3
"""Loads of the snapshot at start when the stream was purged past the loaded one meanwhile (another
replica's newer snapshot covers the purge); after that the replica starts partial."""


def slug(name: str) -> str:
    """The reference's ``Slug``: ``/``, ``\\``, ``.`` and ``_`` become ``-``."""
    for char in "/\\._":
        name = name.replace(char, "-")
    return name


def stream_name(subjects: Subjects) -> str:
    """``namespace-{ns}-component-{comp}-kv-events``: the reference's stream over ``Subjects.kv_events``."""
    return slug(subjects.kv_events)


def bucket_name(subjects: Subjects) -> str:
    """``namespace-{ns}-component-{comp}-radix-bucket`` (``spec/dynamo-semantics.md`` §6.4)."""
    return slug(f"{subjects.prefix}-{BUCKET_SUFFIX}")


def consumer_name(router_id: str | None, host: str, port: int) -> str:
    """The durable consumer of this replica: ``kvrouter-<router_id>``, by default ``kvrouter-<hostname>-<port>``
    (stable across restarts on the same host and port); with port 0 a random one, logged, since a restart
    cannot find it again (pass ``--router-id``)."""
    if router_id is None:
        if port:
            router_id = f"{socket.gethostname()}-{port}"
        else:
            router_id = uuid.uuid4().hex[:12]
            log.warning("durable consumer name random router_id=%s: pass --router-id to keep it", router_id)
        router_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in router_id)
    return f"kvrouter-{router_id}"


@dataclass(slots=True)
class DurableCounters:
    """What the durable consumer and the snapshots did (``/metrics``, ``/ready``)."""

    received: int = 0
    """Stream messages fetched."""
    redelivered: int = 0
    """Fetched messages at or below the stream sequence already processed: dropped."""
    snapshot_loads: int = 0
    snapshot_uploads: int = 0
    snapshot_bad: int = 0
    """Snapshot objects that did not decode: the replica replayed the stream instead."""
    snapshot_failures: int = 0
    """Snapshots or purges NATS refused (retried at the next check)."""
    purged: int = 0
    """Stream messages removed by this replica's purges."""


class DurableEvents:
    """One replica's durable consumer, snapshot loader and snapshot taker; feeds ``relay`` (durable mode).

    Not thread-safe: runs on the service's event loop (:meth:`run` until cancelled, then :meth:`close`).

    Args:
        relay: the relay in durable mode that keeps the ranks' state and relays to the appliers.
        subjects: the namespace and component (stream, bucket and subject names).
        url: the NATS server.
        consumer: the durable consumer's name (:func:`consumer_name`).
        snapshot_threshold: stream messages from which a snapshot is taken and the stream purged.
        reset_states: delete the bucket and purge the stream at start.
    """

    def __init__(
        self,
        relay: NatsEventRelay,
        subjects: Subjects,
        *,
        url: str,
        consumer: str,
        snapshot_threshold: int,
        reset_states: bool = False,
    ) -> None:
        self.relay = relay
        self.subjects = subjects
        self.url = url
        self.consumer = consumer
        self.snapshot_threshold = snapshot_threshold
        self.reset_states = reset_states
        self.stream = stream_name(subjects)
        self.bucket = bucket_name(subjects)
        self.counters = DurableCounters()
        self.connected = False
        self.loaded = False
        """The start is done (stream found, snapshot loaded or not, consumer made): ranks may register."""
        self.caught_up = False
        """The stream is processed up to its last sequence at start: ``/ready`` may say so."""
        self.processed_seq = 0
        """The last stream sequence handed to the relay."""
        self.target_seq = 0
        """The stream's last sequence when this replica started reading it."""
        self.snapshot_seq: int | None = None
        """The stream sequence of the snapshot loaded at start (None: none loaded)."""
        self.last_snapshot: dict[str, Any] | None = None
        """The last snapshot this replica uploaded: ``{"seq", "bytes", "ranks", "purged_below", "seconds"}``."""
        self._nc: Any = None
        self._js: Any = None
        self._logged: set[str] = set()
        self._relaying = asyncio.Lock()
        """Held while a fetched batch is relayed and while a snapshot dumps the ranks: never both."""

    def _once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (logged once)", *args)

    # -- start ----------------------------------------------------------------------------------

    async def _connect(self) -> None:
        while True:
            try:
                self._nc = await nats.connect(
                    self.url,
                    name=f"kvrouter-durable-{self.consumer}",
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    connect_timeout=2,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error,
                )
                break
            except Exception as exc:  # nats-py raises OSError, NoServersError, TimeoutError ...
                self._once("connect", "durable kv-events cannot reach NATS url=%s error=%r; retrying", self.url, exc)
                await asyncio.sleep(RETRY_S)
        self._js = self._nc.jetstream()
        self.connected = self.relay.connected = True

    async def _on_disconnected(self) -> None:
        self.connected = self.relay.connected = False
        log.warning("durable kv-events disconnected from NATS url=%s", self.url)

    async def _on_reconnected(self) -> None:
        self.connected = self.relay.connected = True
        log.info("durable kv-events reconnected url=%s", self.url)

    async def _on_error(self, exc: Exception) -> None:
        self._once(f"nats_{type(exc).__name__}", "durable kv-events NATS error=%r", exc)

    async def _ensure_stream(self) -> None:
        js = self._js
        try:
            await js.stream_info(self.stream)
        except NotFoundError:
            await js.add_stream(name=self.stream, subjects=[self.subjects.kv_events], storage=api.StorageType.FILE)
            log.info("durable stream created stream=%s subject=%s", self.stream, self.subjects.kv_events)

    async def _reset(self) -> None:
        js = self._js
        for delete in (js.delete_object_store, js.delete_key_value):
            with contextlib.suppress(NotFoundError, BucketNotFoundError):
                await delete(self.bucket)
        await js.purge_stream(self.stream)
        log.warning("durable state reset bucket=%s stream=%s (deleted, purged)", self.bucket, self.stream)

    async def _download(self) -> bytes | None:
        """The snapshot object's bytes, read until its metadata agrees before and after; None without one."""
        try:
            store = await self._js.object_store(self.bucket)
        except BucketNotFoundError:
            return None
        for _ in range(SNAPSHOT_READ_TRIES):
            try:
                before = await store.get_info(SNAPSHOT_OBJECT)
                result = await store.get(SNAPSHOT_OBJECT)
                after = await store.get_info(SNAPSHOT_OBJECT)
            except ObjectNotFoundError:
                return None
            except Exception as exc:  # a digest mismatch while the object was being replaced, a timeout
                self._once("snapshot_read", "durable snapshot read failed bucket=%s error=%r", self.bucket, exc)
            else:
                if before.nuid == after.nuid == result.info.nuid:
                    data: bytes = result.data
                    return data
            await asyncio.sleep(SNAPSHOT_READ_PAUSE_S)
        log.error(
            "durable snapshot never read twice alike bucket=%s tries=%d: replaying the stream",
            self.bucket,
            SNAPSHOT_READ_TRIES,
        )
        return None

    async def _load_snapshot(self) -> int:
        """Load the snapshot into the relay; the stream sequence to resume after (0 without one).

        A snapshot past the stream's last sequence (read after the download, so a snapshot taken meanwhile
        is below it) belongs to an earlier stream, deleted and made again with sequences starting over: it
        is refused as bad, since resuming after it would skip the new stream's events.
        """
        data = await self._download()
        if data is None:
            log.info("durable start without snapshot bucket=%s: replaying the stream", self.bucket)
            return 0
        last_seq = (await self._js.stream_info(self.stream)).state.last_seq
        try:
            snapshot = decode_snapshot(data)
        except BadMessage as exc:
            self.counters.snapshot_bad += 1
            log.error(
                "durable snapshot unreadable bucket=%s object=%s bytes=%d error=%s: replaying the stream from its "
                "first message instead (counted snapshot_bad)",
                self.bucket,
                SNAPSHOT_OBJECT,
                len(data),
                exc,
            )
            return 0
        if snapshot.stream_seq > last_seq:
            self.counters.snapshot_bad += 1
            log.error(
                "durable snapshot ahead of the stream bucket=%s snapshot_seq=%d stream_last_seq=%d (the stream was "
                "made again?): replaying the stream from its first message instead (counted snapshot_bad)",
                self.bucket,
                snapshot.stream_seq,
                last_seq,
            )
            return 0
        self.relay.load(snapshot.ranks)
        self.counters.snapshot_loads += 1
        self.snapshot_seq = snapshot.stream_seq
        log.info(
            "durable snapshot loaded bucket=%s seq=%d ranks=%d bytes=%d",
            self.bucket,
            snapshot.stream_seq,
            len(snapshot.ranks),
            len(data),
        )
        return snapshot.stream_seq

    async def _make_consumer(self, after: int) -> Any:
        """(Re)create this replica's durable consumer to deliver from ``after + 1``; its pull subscription."""
        js = self._js
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(self.stream, self.consumer)
        config = api.ConsumerConfig(
            durable_name=self.consumer,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if after else api.DeliverPolicy.ALL,
            opt_start_seq=after + 1 if after else None,
            ack_policy=api.AckPolicy.ALL,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=MAX_ACK_PENDING,
            filter_subject=self.subjects.kv_events,
            inactive_threshold=CONSUMER_INACTIVE_S,
        )
        await js.add_consumer(self.stream, config)
        return await js.pull_subscribe_bind(durable=self.consumer, stream=self.stream)

    async def start(self) -> Any:
        """Connect, make the stream, reset or load the snapshot, make the consumer; its pull subscription."""
        if self._nc is None:
            await self._connect()
        await self._ensure_stream()
        if self.reset_states:
            await self._reset()
        for attempt in range(1, START_TRIES + 1):
            self.relay.clear()
            bad = self.counters.snapshot_bad
            after = await self._load_snapshot()
            psub = await self._make_consumer(after)  # from here its ack floor holds back others' purges
            info = await self._js.stream_info(self.stream)
            if info.state.first_seq <= after + 1:
                break
            if attempt < START_TRIES and self.counters.snapshot_bad == bad:
                # another replica may have snapshotted and purged meanwhile: its newer snapshot covers the purge
                log.info(
                    "durable stream purged past the resume point, loading the snapshot again stream=%s first_seq=%d "
                    "resume_after=%d try=%d",
                    self.stream,
                    info.state.first_seq,
                    after,
                    attempt,
                )
                continue
            # purged past what this replica holds (a bad snapshot, a reset): each rank asks its worker
            self.relay.partial = True
            log.warning(
                "durable stream lost messages this replica needs stream=%s first_seq=%d resume_after=%d: "
                "each rank is repaired from its worker at its first query",
                self.stream,
                info.state.first_seq,
                after,
            )
            break
        self.processed_seq = after
        self.target_seq = info.state.last_seq if info.state.messages else after
        self.caught_up = self.processed_seq >= self.target_seq
        self.loaded = True
        log.info(
            "durable consumer reading stream=%s consumer=%s from=%d target=%d",
            self.stream,
            self.consumer,
            after + 1,
            self.target_seq,
        )
        return psub

    # -- run ------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start (retrying every ``RETRY_S`` while NATS refuses a step), then consume and snapshot until
        cancelled."""
        while True:
            try:
                psub = await self.start()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a JetStream request refused or timed out: start again
                self._once("start", "durable start failed stream=%s error=%r; retrying", self.stream, exc)
                await asyncio.sleep(RETRY_S)
        snapshots = asyncio.get_running_loop().create_task(self._snapshots(), name="kvrouter-durable-snapshots")
        try:
            await self._consume(psub)
        finally:
            snapshots.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await snapshots

    async def _consume(self, psub: Any) -> None:
        counters = self.counters
        relay = self.relay
        while True:
            try:
                messages = await psub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
            except nats.errors.TimeoutError:
                if not self.caught_up:
                    with contextlib.suppress(Exception):
                        info = await psub.consumer_info()
                        if info.num_pending == 0:
                            self._caught_up()
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # disconnected, the consumer deleted by the server: retry
                self._once("fetch", "durable fetch failed consumer=%s error=%r; retrying", self.consumer, exc)
                await asyncio.sleep(RETRY_S)
                continue
            async with self._relaying:  # not while a snapshot is being taken, rank by rank
                for msg in messages:  # hot path: one relay call per stream message
                    counters.received += 1
                    seq = msg.metadata.sequence.stream
                    if seq <= self.processed_seq:
                        counters.redelivered += 1
                        continue
                    relay.relay(msg.data)
                    self.processed_seq = seq
            if messages:
                with contextlib.suppress(Exception):  # an ack lost is a redelivery, dropped by the cursor
                    await messages[-1].ack()
            if not self.caught_up and self.processed_seq >= self.target_seq:
                self._caught_up()

    def _caught_up(self) -> None:
        self.caught_up = True
        log.info("durable consumer caught up stream=%s seq=%d", self.stream, self.processed_seq)

    # -- snapshots ------------------------------------------------------------------------------

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S + random.uniform(-CHECK_JITTER_S, CHECK_JITTER_S))
            if not self.caught_up or not self.connected:
                continue
            try:
                await self.snapshot_if_due()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS refused a step: retried at the next check
                self.counters.snapshot_failures += 1
                self._once("snapshot", "durable snapshot failed bucket=%s error=%r; retrying", self.bucket, exc)

    async def snapshot_if_due(self) -> bool:
        """Snapshot and purge when the stream holds ``snapshot_threshold`` messages, this replica has
        processed that many of them, and the lock is ours.

        Returns:
            Whether a snapshot was uploaded.
        """
        js = self._js
        info = await js.stream_info(self.stream)
        if info.state.messages < self.snapshot_threshold:
            return False
        if self.processed_seq - info.state.first_seq + 1 < self.snapshot_threshold:
            return False  # this replica has not read that many yet: its snapshot would purge less
        try:
            locks = await js.key_value(self.bucket)
        except BucketNotFoundError:
            locks = await js.create_key_value(bucket=self.bucket, ttl=LOCK_TTL_S)
        try:
            await locks.create(LOCK_KEY, self.consumer.encode())
        except KeyWrongLastSequenceError:
            return False  # another replica is taking it
        try:
            await self._snapshot_and_purge(info.state.first_seq)
        finally:
            with contextlib.suppress(Exception):
                await locks.delete(LOCK_KEY)
        return True

    async def _snapshot_and_purge(self, first_seq: int) -> None:
        js = self._js
        started = time.perf_counter()
        async with self._relaying:  # the stream waits: the ranks are exactly the state at ``seq``
            seq = self.processed_seq
            ranks = []
            for key in self.relay.ranks():
                ranks.append(self.relay.rank_state(key))
                await asyncio.sleep(0)  # the routes run between two ranks' dumps
        data = encode_snapshot(seq, ranks)
        try:
            store = await js.object_store(self.bucket)
        except BucketNotFoundError:
            store = await js.create_object_store(self.bucket)
        await store.put(SNAPSHOT_OBJECT, data)
        self.counters.snapshot_uploads += 1
        floors = [c.ack_floor.stream_seq for c in await js.consumers_info(self.stream) if c.ack_floor is not None]
        bound = min([seq, *floors])
        if bound >= first_seq:
            await js.purge_stream(self.stream, seq=bound + 1)  # removes every message below ``bound + 1``
            after = await js.stream_info(self.stream)
            self.counters.purged += max(0, after.state.first_seq - first_seq)
        self.last_snapshot = {
            "seq": seq,
            "bytes": len(data),
            "ranks": len(ranks),
            "purged_below": bound + 1,
            "seconds": round(time.perf_counter() - started, 3),
        }
        log.info(
            "durable snapshot uploaded bucket=%s seq=%d bytes=%d ranks=%d purged_below=%d",
            self.bucket,
            seq,
            len(data),
            len(ranks),
            bound + 1,
        )

    # -- status and close ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``/ready``'s ``durable_events``."""
        return {
            "connected": self.connected,
            "loaded": self.loaded,
            "caught_up": self.caught_up,
            "stream": self.stream,
            "consumer": self.consumer,
            "bucket": self.bucket,
            "processed_seq": self.processed_seq,
            "target_seq": self.target_seq,
            "snapshot_loaded": self.snapshot_seq is not None,
            "snapshot_seq": self.snapshot_seq,
            "last_snapshot": self.last_snapshot,
            **asdict(self.counters),
        }

    async def close(self) -> None:
        """Delete this replica's consumer (as the reference does on shutdown: its cursor is worthless to the
        next start, which resumes after the snapshot, and it would hold back the purge), disconnect.
        Idempotent. A replica that dies without closing leaves its consumer; the next start under the same
        ``router_id`` replaces it, or the server removes it after ``CONSUMER_INACTIVE_S``."""
        nc, self._nc = self._nc, None
        self.connected = False
        if nc is None:
            return
        if self.loaded:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._js.delete_consumer(self.stream, self.consumer), CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await nc.close()
